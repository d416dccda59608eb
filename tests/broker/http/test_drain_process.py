"""The drain as an operator meets it: `mergebroker serve` as a real process drains on SIGTERM while still
listening (a second SIGTERM ends the drain with the streams' error events), and `mergebroker drain` waits on
a running broker and exits 0 once it is idle."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.broker.http.test_drain_streams import TIERS, _body, _data, _drain, _open, gated  # noqa: F401 - a fixture
from tests.conftest import free_port, provider_for
from tests.helpers.polling import wait_until

START_S = 60


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MERGEBROKER_")}
    return {**env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **extra}


class Serving:
    """`mergebroker serve` on a free loopback port, over the test's simulator; its output in a log file."""

    def __init__(self, tmp_path: Path, sim: Any) -> None:
        self.port = free_port()
        config = tmp_path / "broker.yaml"
        config.write_text(yaml.safe_dump({
            "providers": [provider_for(sim)], "tiers": TIERS, "merge": {"embedder": "none"},
            "server": {"host": "127.0.0.1", "port": self.port, "drain_timeout_s": 30}}))
        self.log = tmp_path / "serve.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "mergebroker.broker.cli", "serve", "--config",
                                          str(config)], stdout=out, stderr=subprocess.STDOUT, env=_env())
        self.url = f"http://127.0.0.1:{self.port}"
        self.http = aiohttp.ClientSession(base_url=self.url)

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    async def readyz(self) -> tuple[int, dict[str, Any]]:
        assert self.proc.poll() is None, self.output()
        async with self.http.get("/readyz") as resp:
            return resp.status, await resp.json()

    async def exited(self) -> int:
        return await asyncio.to_thread(self.proc.wait, 20)

    async def close(self) -> None:
        await self.http.close()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
async def serving(gated, tmp_path):  # noqa: F811 - the fixture imported above
    sim, gate = gated
    broker = Serving(tmp_path, sim)
    try:
        # Another process: no event says when it listens.
        await wait_until(lambda: _status(broker, 200), START_S, broker.output, interval_s=0.1,
                         ignoring=(aiohttp.ClientError,))
        yield broker, gate
    finally:
        await broker.close()


async def _status(broker: Serving, wanted: int) -> dict[str, Any] | None:
    status, body = await broker.readyz()
    return body if status == wanted else None


async def test_sigterm_drains_while_listening_then_the_process_exits(serving):
    broker, gate = serving
    streams = await _open(broker, ["chat", "chat", "messages"])
    broker.proc.send_signal(signal.SIGTERM)
    # The signal is handled in the other process: its readiness is polled.
    ready = await wait_until(lambda: _status(broker, 503), 10, broker.output)
    assert ready["reason"] == "draining: SIGTERM received, 3 requests in flight"
    async with broker.http.post("/v1/chat/completions", json=_body("chat", "new", stream=False)) as resp:
        assert resp.status == 503 and (await resp.json())["error"]["code"] == "shutting_down"
    gate.open.set()
    for stream in streams:
        text = await asyncio.wait_for(stream.done, 10)
        assert "error" not in text and text.rstrip().endswith(("data: [DONE]", '{"type":"message_stop"}'))
    assert await broker.exited() == 0
    events = {e["event"]: e for e in _json_lines(broker.log) if "drain" in e["event"]}
    assert events["drain_started"]["reason"] == "SIGTERM received" and events["drain_started"]["in_flight"] == 3
    assert events["drain_ended"]["outcome"] == "drained" and events["drain_ended"]["cut"] == 0
    assert "request_id" not in events["drain_ended"]


def _json_lines(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]


async def test_a_second_sigterm_ends_the_drain_at_once_with_the_streams_error_events(serving):
    broker, _gate = serving
    [stream] = await _open(broker, ["chat"])
    broker.proc.send_signal(signal.SIGTERM)
    await wait_until(lambda: _status(broker, 503), 10, broker.output)
    started = time.monotonic()
    broker.proc.send_signal(signal.SIGTERM)
    last = json.loads(_data(await asyncio.wait_for(stream.done, 10))[-1])  # no ClientPayloadError
    assert last["error"]["code"] == "shutting_down"
    assert await broker.exited() == 0
    assert time.monotonic() - started < 10  # not the 30 s drain timeout


async def _drain_command(port: int, *args: str) -> tuple[int, str]:
    """`mergebroker drain` with only the port in the environment, as a preStop hook runs it in the pod."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "mergebroker.broker.cli", "drain", *args,
        env=_env(MERGEBROKER_SERVER__PORT=str(port)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode()


async def test_the_drain_command_waits_for_a_running_broker_and_exits_0_once_it_is_idle(gated, start_broker):  # noqa: F811
    sim, gate = gated
    broker = await start_broker({"providers": [provider_for(sim)], "tiers": TIERS, "merge": {"embedder": "none"},
                                 "server": {"drain_timeout_s": 30}})
    [stream] = await _open(broker, ["chat"])
    code, out = await _drain_command(broker.port, "--timeout", "0")
    assert code == 1 and json.loads(out.splitlines()[-1]) == {"drained": False, "in_flight": 1}
    drain = _drain(broker)
    assert drain.draining  # the first call began it; the second waits on the same drain
    called, wait = asyncio.Event(), drain.wait

    def seen_wait(timeout_s: float | None = None) -> Any:
        called.set()
        return wait(timeout_s)

    drain.wait = seen_wait  # type: ignore[method-assign]
    waiting = asyncio.ensure_future(_drain_command(broker.port))
    await asyncio.wait_for(called.wait(), 30)
    assert not waiting.done()
    gate.open.set()
    code, out = await waiting
    assert code == 0 and json.loads(out.splitlines()[-1]) == {"drained": True, "in_flight": 0}, out
    assert _data(await stream.done)[-1] == "[DONE]"


async def test_the_drain_command_exits_2_when_no_broker_answers():
    code, out = await _drain_command(free_port(), "--timeout", "1")
    assert code == 2 and "cannot drain" in out
