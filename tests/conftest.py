"""Shared fixtures: free loopback ports, a fake clock, a real Redis server, the simulated upstream."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from mergebroker.clock import FakeClock  # noqa: E402
from tests.helpers.processes import wait_for_port_blocking  # noqa: E402


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock()


class RedisServer:
    """A real redis-server on a free loopback port, started and stopped by the tests."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="mb-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed (scripts/setup.sh installs it)")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port_blocking(self.port, proc=self.proc, timeout_s=10, probe=_answers_ping)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.dir, ignore_errors=True)


@pytest.fixture
async def simulator():
    """The simulated upstream as a real server on a free loopback port."""
    from mergebroker.providers.simulator.server import start_simulator

    sim = await start_simulator()
    try:
        yield sim
    finally:
        await sim.close()


class BrokerUnderTest:
    """A broker running as a real aiohttp server on 127.0.0.1, with an HTTP session and an OpenAI client."""

    def __init__(self, runner, broker, port: int, batches=None) -> None:
        import aiohttp
        import openai

        self.runner, self.broker, self.port = runner, broker, port
        self.batches = batches  # the Batch API's service, when enabled
        self.url = f"http://127.0.0.1:{port}"
        self.http = aiohttp.ClientSession(base_url=self.url)
        self.openai = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="test-key", max_retries=0)

    async def chat(self, content: str, *, model: str = "sim-small", headers: dict | None = None,
                   system: str | None = None, **extra):
        """POST one chat completion; returns (status, json body, headers)."""
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
        async with self.http.post("/v1/chat/completions", json={"model": model, "messages": messages, **extra},
                                  headers=headers or {}) as resp:
            return resp.status, await resp.json(), resp.headers

    async def close(self) -> None:
        await self.http.close()
        await self.openai.close()
        await self.runner.cleanup()


@pytest.fixture
async def start_broker():
    """Factory: `await start_broker(settings_dict)` runs a broker on a free port; all are stopped at the end."""
    from aiohttp import web

    from mergebroker.broker.engine.ground.config import load_settings
    from mergebroker.broker.http.app import create_app
    from mergebroker.broker.http.keys import BATCHES, BROKER

    started: list[BrokerUnderTest] = []

    async def start(config: dict | None = None, *, clock=None, environ: dict | None = None) -> BrokerUnderTest:
        settings = load_settings(None, environ=environ or {}, overrides=config or {})
        app = create_app(settings, **({"clock": clock} if clock else {}))
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        b = BrokerUnderTest(runner, app[BROKER], port, app.get(BATCHES))
        started.append(b)
        return b

    yield start
    for b in started:
        await b.close()


def provider_for(sim, name: str = "sim", **extra) -> dict:
    """Provider settings pointing at a simulator."""
    return {"name": name, "base_url": sim.url, **extra}


NO_MERGE_MODEL = {"merge": {"embedder": "none"}}
