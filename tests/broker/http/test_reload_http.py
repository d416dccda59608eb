"""Config reload on a running broker: POST /v1/broker/reload (and SIGHUP on `mergebroker serve`) applies rotated
keys, a tier's new RPM and an added provider to requests that arrive after it, while requests and streams
already in flight finish on the engine they started on; a config that does not validate is refused with the
reason and the running one keeps serving."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
from functools import partial

import aiohttp
import pytest
import yaml
from aiohttp import web

from mergebroker.broker.engine.ground.config import load_settings
from mergebroker.broker.engine.ground.settings import default_tiers
from mergebroker.broker.http.app import create_app
from mergebroker.providers.simulator.faults import SimulatorConfig
from mergebroker.providers.simulator.server import start_simulator
from tests.conftest import free_port
from tests.helpers.polling import wait_until
from tests.helpers.processes import wait_for_port_blocking

OLD_KEY, NEW_KEY = "sk-old-key", "sk-new-key"


def _key(token: str, tenant: str) -> dict:
    return {"sha256": hashlib.sha256(token.encode()).hexdigest(), "tenant": tenant, "tiers": ["standard"]}


def _config(sim_url: str, *, key: str, rpm: int, providers: int = 1) -> dict:
    return {"providers": [{"name": f"sim{i}", "base_url": sim_url} for i in range(providers)],
            "auth": {"mode": "keys", "keys": [_key(key, "acme")]},
            "tiers": [{"name": "standard", "rpm": rpm, "window_ms": 0}], "default_tier": "standard",
            "merge": {"embedder": "none"}, "cache": {"enabled": False}}


class HeldUpstream:
    """The simulator's latency, held until the test lets the calls through: requests stay in flight."""

    def __init__(self) -> None:
        self.waiting = 0
        self.go = asyncio.Event()

    async def sleep(self, _seconds: float) -> None:
        self.waiting += 1
        await self.go.wait()


def _chat(text: str, **extra) -> dict:
    return {"model": "sim-small", "messages": [{"role": "user", "content": text}], "max_tokens": 16, **extra}


async def _stream(http: aiohttp.ClientSession, url: str, key: str, text: str) -> tuple[int, bytes]:
    async with http.post(url + "/v1/chat/completions", json=_chat(text, stream=True),
                         headers={"Authorization": f"Bearer {key}"}) as resp:
        return resp.status, await resp.read()


async def _ask(http: aiohttp.ClientSession, url: str, key: str, text: str) -> int:
    async with http.post(url + "/v1/chat/completions", json=_chat(text),
                         headers={"Authorization": f"Bearer {key}"}) as resp:
        await resp.read()
        return resp.status


@pytest.fixture
async def reloadable(tmp_path):
    """A broker served from a config file it can re-read; yields (url, config path, held upstream, simulator)."""
    held = HeldUpstream()
    sim = await start_simulator(SimulatorConfig(latency_base_ms=1), sleep=held.sleep)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(_config(sim.url, key=OLD_KEY, rpm=1000)))
    settings = load_settings(path, environ={})
    app = create_app(settings, reload_from=partial(load_settings, path, environ={}))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", path, held, sim
    finally:
        held.go.set()
        await runner.cleanup()
        await sim.close()


async def test_a_reload_applies_to_new_requests_while_those_in_flight_finish(reloadable):
    url, path, held, sim = reloadable
    async with aiohttp.ClientSession() as http:
        in_flight = [asyncio.ensure_future(_ask(http, url, OLD_KEY, f"question {i}")) for i in range(8)]
        streams = [asyncio.ensure_future(_stream(http, url, OLD_KEY, f"streamed {i}")) for i in range(4)]
        await wait_until(lambda: held.waiting == 12, 10, lambda: f"{held.waiting} of 12 calls upstream")

        path.write_text(yaml.safe_dump(_config(sim.url, key=NEW_KEY, rpm=2, providers=2)))
        async with http.post(url + "/v1/broker/reload") as resp:
            assert resp.status == 200
            result = await resp.json()
        paths = {c["path"] for c in result["changes"]}
        assert result["result"] == "applied"
        assert {"auth.keys", "tiers[standard].rpm", "providers[sim1].base_url"} <= paths
        assert all(c["old"] == c["new"] == "***" for c in result["changes"] if c["path"] == "auth.keys")

        held.go.set()
        assert await asyncio.gather(*in_flight) == [200] * 8  # started on the old engine: all answered
        for status, body in await asyncio.gather(*streams):
            assert status == 200 and body.rstrip().endswith(b"data: [DONE]")

        assert await _ask(http, url, OLD_KEY, "rotated out") == 401
        assert [await _ask(http, url, NEW_KEY, f"after {i}") for i in range(3)] == [200, 200, 429]  # rpm 2

        path.write_text("tiers: [{name: standard, rpm: -5}]\n")
        async with http.post(url + "/v1/broker/reload") as resp:
            assert resp.status == 422
            refused = await resp.json()
        assert refused["result"] == "refused" and "rpm" in refused["reason"]
        assert refused["error"]["code"] == "config_refused"
        assert await _ask(http, url, NEW_KEY, "still limited") == 429  # the running config stays
        async with http.get(url + "/v1/models", headers={"Authorization": f"Bearer {NEW_KEY}"}) as resp:
            assert resp.status == 200


async def test_settings_only_a_restart_can_change_are_refused_by_name(reloadable):
    url, path, _held, sim = reloadable
    config = _config(sim.url, key=OLD_KEY, rpm=1000)
    path.write_text(yaml.safe_dump({**config, "server": {"port": 1}}))
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/broker/reload") as resp:
            assert resp.status == 422
            assert "server.port" in (await resp.json())["reason"]
        path.write_text(yaml.safe_dump(config))
        async with http.post(url + "/v1/broker/reload") as resp:
            assert (await resp.json())["result"] == "unchanged"
        async with http.post(url + "/v1/broker/reload", headers={"X-Forwarded-For": "203.0.113.9"}) as resp:
            assert resp.status == 403  # not through a proxy: only a loopback peer or the metrics token


def test_sighup_reloads_a_running_mergebroker_serve(tmp_path):
    """The real command: after the config file changes, SIGHUP applies it (a new tier shows in the stats)."""
    port = free_port()
    path = tmp_path / "config.yaml"
    base = {"server": {"port": port}, "merge": {"embedder": "none"}}
    path.write_text(yaml.safe_dump(base))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "mergebroker.broker.cli", "serve", "--config", str(path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        wait_for_port_blocking(port, timeout_s=90)

        async def tiers() -> set[str]:
            async with aiohttp.ClientSession() as http:
                async with http.get(f"http://127.0.0.1:{port}/v1/broker/stats") as resp:
                    return set((await resp.json())["tiers"])

        assert "gold" not in asyncio.run(tiers())
        tiers_now = [t.model_dump(mode="json") for t in default_tiers()]
        path.write_text(yaml.safe_dump({**base, "tiers": [*tiers_now, {"name": "gold", "priority": 5}]}))
        proc.send_signal(signal.SIGHUP)

        async def reloaded() -> bool:
            return "gold" in await tiers()

        asyncio.run(wait_until(reloaded, 30, "the reload never showed the new tier"))
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert b"config_reload" in err and b'"result":"applied"' in err
