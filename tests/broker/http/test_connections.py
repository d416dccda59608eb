"""Client connections are bounded: slow headers, slow bodies and idle keep-alives close, the cap closes
stalled connections first, and a slow-headers flood past the open-file limit leaves other clients served."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
import subprocess
import sys
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web
from structlog.testing import capture_logs

from mergebroker.broker.engine.ground.config import load_settings
from mergebroker.broker.http.app import create_app
from mergebroker.broker.http.connections import Conn, ConnectionLimits, eviction_order, expired
from mergebroker.broker.http.server import CONNECTIONS, AcceptErrorLog, GuardedSite, runner_for
from mergebroker.clock import FakeClock
from tests.conftest import free_port, provider_for
from tests.helpers.polling import wait_until
from tests.helpers.processes import wait_for_port_blocking

LIMITS = ConnectionLimits(max_connections=4, header_timeout_s=5, body_timeout_s=10, idle_timeout_s=20)
PARTIAL = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"


def _conn(**state: Any) -> Conn:
    return Conn(object(), None, **state)  # type: ignore[arg-type]


def test_expired_names_the_limit_each_stage_passed():
    assert expired(_conn(waiting_since=0, headers_since=0), 6, LIMITS) == "header_timeout"
    assert expired(_conn(waiting_since=0, headers_since=0), 4, LIMITS) is None
    assert expired(_conn(waiting_since=0), 6, LIMITS) is None  # idle, not past the idle limit
    assert expired(_conn(waiting_since=0), 21, LIMITS) == "idle_timeout"
    slow_body = _conn(waiting_since=0, request_since=1, body_done=lambda: False)
    assert expired(slow_body, 12, LIMITS) == "body_timeout"
    busy = _conn(waiting_since=0, request_since=1, body_done=lambda: True)
    assert expired(busy, 1000, LIMITS) is None  # a request being served is never cut off here


def test_eviction_closes_incomplete_headers_first_then_bodies_then_idle_and_never_busy():
    idle = _conn(waiting_since=1)
    headers_new, headers_old = _conn(waiting_since=5, headers_since=5), _conn(waiting_since=2, headers_since=2)
    body = _conn(waiting_since=0, request_since=3, body_done=lambda: False)
    busy = _conn(waiting_since=0, request_since=0, body_done=lambda: True)
    assert eviction_order([idle, busy, headers_new, body, headers_old]) == [headers_old, headers_new, body, idle]


def test_accept_errors_log_once_per_interval():
    clock = FakeClock()
    handler = AcceptErrorLog(10, clock=clock)
    context = {"message": "socket.accept() out of system resource", "exception": OSError(24, "Too many open files")}
    with capture_logs() as logged:
        for _ in range(1000):
            handler(None, context)  # type: ignore[arg-type]
        clock.advance(10)
        handler(None, context)  # type: ignore[arg-type]
    assert [e["event"] for e in logged] == ["accept_failed", "accept_failed"]
    assert logged[1]["suppressed_since_last"] == 999


@pytest.fixture
async def guarded(simulator):
    """Factory: a broker served through a `GuardedSite` on a fake clock; returns (url, app, clock)."""
    runners: list[web.AppRunner] = []

    async def start(server: dict, **config: Any) -> tuple[str, web.Application, FakeClock]:
        clock = FakeClock()
        settings = load_settings(None, environ=config.pop("environ", {}), overrides={
            "providers": [provider_for(simulator)], "merge": {"embedder": "none"}, "server": server, **config})
        app = create_app(settings, clock=clock)
        runner = runner_for(app, settings.server)
        await runner.setup()
        runners.append(runner)
        site = GuardedSite(runner, app[CONNECTIONS], "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site.port}", app, clock

    yield start
    for runner in runners:
        await runner.cleanup()


async def _open(url: str, send: bytes = b"") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    if send:
        writer.write(send)
        await writer.drain()
    return reader, writer


async def _settled(app: web.Application, count: int) -> None:
    """Wait until the guard tracks `count` connections (accepting is the loop's business, not ours)."""
    await wait_until(lambda: len(app[CONNECTIONS]) == count, 5,
                     lambda: f"{len(app[CONNECTIONS])} connections tracked, expected {count}")


async def test_slow_headers_and_idle_connections_are_closed_at_their_limits(guarded):
    url, app, clock = await guarded({"header_timeout_s": 5, "idle_timeout_s": 20})
    slow_reader, _ = await _open(url, PARTIAL)
    idle_reader, _ = await _open(url)
    await _settled(app, 2)
    clock.advance(6)
    assert app[CONNECTIONS].sweep() == 1
    assert await asyncio.wait_for(slow_reader.read(), 5) == b""  # closed: EOF
    clock.advance(15)
    assert app[CONNECTIONS].sweep() == 1
    assert await asyncio.wait_for(idle_reader.read(), 5) == b""


def test_header_time_counts_from_the_requests_first_byte_not_from_the_last_response():
    reused = _conn(waiting_since=0, headers_since=12)  # idled 12 s on keep-alive, then began a request
    assert expired(reused, 13, LIMITS) is None
    assert expired(reused, 18, LIMITS) == "header_timeout"


MODELS = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"


async def _response(reader: asyncio.StreamReader) -> bytes:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    await reader.readexactly(length)
    return head


async def test_a_keep_alive_connection_reused_after_idling_past_the_header_limit_is_served(guarded):
    """The keep-alive race a client saw as ServerDisconnectedError: its connection idled longer than
    header_timeout_s (below idle_timeout_s), its next request's first bytes arrived, and the sweep ran before
    the handler started; the header time was counted from the end of the last response, so it closed."""
    url, app, clock = await guarded({"header_timeout_s": 5, "idle_timeout_s": 20})
    reader, writer = await _open(url, MODELS)
    assert (await _response(reader)).startswith(b"HTTP/1.1 200")
    clock.advance(12)  # idle on keep-alive: past the header limit, within the idle one
    writer.write(MODELS[:20])  # the next request's first bytes, as a loaded loop would see them before the rest
    await writer.drain()
    await wait_until(lambda: app[CONNECTIONS].stages()["headers"] == 1, 5, lambda: f"{app[CONNECTIONS].stages()}")
    assert app[CONNECTIONS].sweep() == 0
    writer.write(MODELS[20:])
    await writer.drain()
    assert (await _response(reader)).startswith(b"HTTP/1.1 200")
    writer.write(MODELS[:20])  # headers that never complete still close at the header limit, from their first byte
    await writer.drain()
    await wait_until(lambda: app[CONNECTIONS].stages()["headers"] == 1, 5, lambda: f"{app[CONNECTIONS].stages()}")
    clock.advance(6)
    assert app[CONNECTIONS].sweep() == 1
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()


async def test_a_slow_body_gets_408_in_the_envelope(guarded):
    url, app, clock = await guarded({"body_timeout_s": 0.2})
    reader, writer = await _open(url, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                      b"application/json\r\nContent-Length: 100\r\n\r\n{\"model\"")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 408")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    body = json.loads(await reader.readexactly(length))
    assert body["error"]["code"] == "request_timeout"
    writer.close()


async def test_at_the_cap_stalled_connections_are_closed_first_and_clients_are_served(guarded):
    # No merge window: on the fake clock a window would stay open until the test moved the clock.
    url, app, clock = await guarded({"max_connections": 4}, tiers=[{"name": "standard", "window_ms": 0}],
                                    default_tier="standard")
    stalled = [await _open(url, PARTIAL) for _ in range(4)]
    await _settled(app, 4)
    async with aiohttp.ClientSession() as http:
        for i in range(3):
            async with http.post(url + "/v1/chat/completions", json={
                    "model": "sim-small", "messages": [{"role": "user", "content": f"hi {i}"}],
                    "broker": {"merge": False}}) as resp:  # no merge window: the fake clock never closes one
                assert resp.status == 200
    closed = [await asyncio.wait_for(r.read(), 5) == b"" for r, _ in stalled[:1]]
    assert closed == [True]  # the oldest stalled one made room (the session reused one connection)
    assert len(app[CONNECTIONS]) <= 4
    for _, w in stalled:
        w.close()


def _limit_fds(n: int):
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))


def test_a_slow_headers_flood_past_the_open_file_limit_leaves_other_clients_served(tmp_path):
    """A real `mergebroker serve` at an open-file limit of 256 and 400 clients that stall in their headers."""
    port = free_port()
    config = tmp_path / "broker.yaml"
    config.write_text(yaml.safe_dump({"server": {"port": port, "reserved_fds": 64}, "merge": {"embedder": "none"},
                                      "logging": {"level": "warning"}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MERGEBROKER_")}
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "mergebroker.broker.cli", "serve", "--config", str(config)],
                                stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_limit_fds(256))
    attackers: list[socket.socket] = []
    try:
        wait_for_port_blocking(port, proc=proc, log=log_path)
        for _ in range(400):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(PARTIAL)
            attackers.append(s)
        served = asyncio.run(_good_clients(port, 20))
        assert served == [200] * 20, log_path.read_text()[-2000:]
    finally:
        for s in attackers:
            s.close()
        proc.terminate()
        proc.wait(timeout=20)
    assert log_path.read_text().count("Too many open files") <= 2


async def _good_clients(port: int, n: int) -> list[int]:
    async def one(i: int) -> int:
        timeout = aiohttp.ClientTimeout(total=15)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as http:
                async with http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={
                        "model": "sim-small", "messages": [{"role": "user", "content": f"q {i}"}]}) as resp:
                    return resp.status
        except (TimeoutError, aiohttp.ClientError):
            return 0

    return list(await asyncio.gather(*(one(i) for i in range(n))))


async def _raw_exchange(url: str, request: bytes) -> tuple[int, dict]:
    reader, writer = await _open(url, request)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    body = json.loads(await reader.readexactly(length))
    writer.close()
    return int(head.split()[1]), body


CHAT = b'{"model": "sim-small", "messages": [{"role": "user", "content": "hi"}]}'


def _post(*headers: bytes, body: bytes = CHAT) -> bytes:
    lines = [b"POST /v1/chat/completions HTTP/1.1", b"Host: x", b"Content-Length: " + str(len(body)).encode(), *headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


@pytest.mark.parametrize("request_bytes", [
    _post(b"X-Big: " + b"a" * 9000),
    _post(b"Content-Type: application/json", b"Content-Type: text/plain"),
    _post(b"X-Bad\x01Name: v"),
    _post(b"X-Ctl: a\x00b"),
])
async def test_what_the_http_parser_rejects_is_answered_in_the_envelope(guarded, request_bytes):
    url, app, clock = await guarded({})
    status, body = await _raw_exchange(url, request_bytes)
    assert 400 <= status < 500 and set(body["error"]) == {"message", "type", "param", "code"}


KEY = "sk-test-key"


@pytest.mark.parametrize("header", [b"Authorization: Bearer \xff\xfe\xfd", b"Authorization: \xc3\x28 key"])
async def test_non_utf8_credentials_get_401_not_500(guarded, header):
    import hashlib

    url, app, clock = await guarded({}, auth={"mode": "keys", "keys": [
        {"sha256": hashlib.sha256(KEY.encode()).hexdigest(), "tenant": "t"}]})
    status, body = await _raw_exchange(url, _post(b"Content-Type: application/json", header))
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("header", [b"X-Broker-Gateway-Secret: \xff\xfe", b"X-Broker-Tenant: \xff\xfe"])
async def test_non_utf8_gateway_headers_get_401_not_500(guarded, header):
    url, app, clock = await guarded({}, auth={"mode": "gateway"}, environ={"MERGEBROKER_GATEWAY_SECRET": "s3cret"})
    extra = [] if header.startswith(b"X-Broker-Gateway") else [b"X-Broker-Gateway-Secret: s3cret"]
    status, body = await _raw_exchange(url, _post(b"Content-Type: application/json", header, *extra))
    assert status == 401
