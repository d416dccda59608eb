"""Operability: a bearer token can guard /metrics and /v1/broker/stats, known label values exist at zero from
the start, a request its client aborts is counted as 499, a stream whose upstream dies mid-way is a failure, and
a request's account (kept after its answer is written) is there for the next read and never costs the answer."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from mergebroker.breaker.circuit import BreakerSettings, CircuitBreaker
from mergebroker.broker.engine.ground.config import ConfigError, load_settings
from mergebroker.errors import UpstreamConnectionError
from mergebroker.providers.pool import ProviderPools
from mergebroker.providers.upstream import Upstream
from tests.conftest import NO_MERGE_MODEL, provider_for
from tests.helpers.polling import wait_until


async def _metrics(broker: Any, **headers: str) -> tuple[int, str]:
    async with broker.http.get("/metrics", headers=headers) as resp:
        return resp.status, await resp.text()


async def test_a_metrics_token_guards_metrics_and_stats(simulator, start_broker):
    broker = await start_broker({"providers": [provider_for(simulator)], **NO_MERGE_MODEL,
                                 "server": {"metrics_token_env": "MB_METRICS"}}, environ={"MB_METRICS": "t0ken"})
    assert (await _metrics(broker))[0] == 401
    assert (await _metrics(broker, Authorization="Bearer wrong"))[0] == 401
    assert (await _metrics(broker, Authorization="Bearer t0ken"))[0] == 200
    async with broker.http.get("/v1/broker/stats") as resp:
        assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_metrics_token"
    async with broker.http.get("/v1/broker/stats", headers={"Authorization": "Bearer t0ken"}) as resp:
        assert resp.status == 200


def test_a_metrics_token_comes_only_from_the_environment(tmp_path):
    with pytest.raises(ConfigError, match="metrics_token_env"):
        load_settings(None, environ={}, overrides={"server": {"metrics_token_env": "MB_UNSET"}})
    config = tmp_path / "c.yaml"
    config.write_text("server:\n  metrics_token: abc\n")
    with pytest.raises(ConfigError, match="environment"):
        load_settings(config, environ={})


async def test_known_label_values_are_exported_at_zero_before_any_event(simulator, start_broker):
    broker = await start_broker({"providers": [provider_for(simulator, models=["sim-small"])], **NO_MERGE_MODEL})
    _, text = await _metrics(broker)
    for series in ('mergebroker_rejected_total{reason="rate_limited",tier="batch"} 0.0',
                   'mergebroker_split_fallback_total{reason="leak"} 0.0',
                   'mergebroker_upstream_calls_total{outcome="5xx",provider="sim"} 0.0',
                   'mergebroker_fast_fail_total{model="sim-small"} 0.0',
                   'mergebroker_breaker_transitions_total{provider="sim",to="open"} 0.0',
                   'mergebroker_cache_events_total{result="coalesced"} 0.0',
                   'mergebroker_connections_closed_total{reason="header_timeout"} 0.0'):
        assert series in text, series


async def test_a_request_its_client_aborts_is_counted_as_499(simulator, start_broker):
    broker = await start_broker({"providers": [provider_for(simulator)], **NO_MERGE_MODEL})
    simulator.set_faults(latency_base_ms=3000)
    with pytest.raises(asyncio.TimeoutError):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as session:
            await session.post(broker.url + "/v1/chat/completions", json={
                "model": "sim-small", "messages": [{"role": "user", "content": "too slow for me"}]})
    pattern = re.compile(r'mergebroker_requests_total\{endpoint="chat",status="499",tier="standard"\} 1\.0')
    async def counted() -> bool:
        return bool(pattern.search((await _metrics(broker))[1]))

    # the broker notices the disconnect on its own loop: no event reaches the test
    await wait_until(counted, 4, "no 499 counted", interval_s=0.02)


async def test_the_account_kept_after_the_answer_is_there_for_the_next_read_and_never_costs_the_answer(
        simulator, start_broker, tmp_path):
    broker = await start_broker({"providers": [provider_for(simulator)], **NO_MERGE_MODEL,
                                 "ledger": {"path": str(tmp_path / "ledger.sqlite3")}})
    status, _, _ = await broker.chat("counted before anyone can ask")
    assert status == 200
    # The very next scrape sees it: the account is kept in the loop turn after the answer was written.
    assert 'mergebroker_requests_total{endpoint="chat",status="200",tier="standard"} 1.0' in (await _metrics(broker))[1]
    ledger = broker.broker.ledger
    assert ledger is not None

    def broken(_record: Any) -> None:
        raise RuntimeError("ledger store gone")

    ledger.record = broken  # type: ignore[method-assign]
    status, body, _ = await broker.chat("answered although the ledger fails")
    assert status == 200 and body["choices"][0]["message"]["content"]
    status, _, _ = await broker.chat("and the next caller too")
    assert status == 200


class _DiesMidStream:
    name = "p"

    async def stream_chat(self, body: dict[str, Any], *, timeout: float) -> AsyncIterator[bytes]:
        yield b'data: {"choices": []}\n\n'
        raise UpstreamConnectionError("upstream connection dropped mid-stream")

    async def close(self) -> None:
        return None


class _Outcomes:
    """A PoolObserver that keeps the call outcomes."""

    def __init__(self) -> None:
        self.outcomes: list[str] = []

    def retried(self, provider: str, reason: str) -> None:
        return None

    def called(self, provider: str, outcome: str, latency_s: float | None) -> None:
        self.outcomes.append(outcome)


async def test_a_stream_whose_upstream_dies_mid_way_counts_as_a_failure(fake_clock):
    breaker = CircuitBreaker("p", BreakerSettings(min_calls=100), clock=fake_clock)
    observer = _Outcomes()
    pools = ProviderPools([Upstream(_DiesMidStream(), breaker=breaker)], clock=fake_clock, observer=observer)
    chunks, _ = await pools.stream_chat("m", {"model": "m"}, deadline=fake_clock() + 30, tenant="t")
    with pytest.raises(UpstreamConnectionError):
        async for _ in chunks:
            pass
    assert observer.outcomes == ["success", "stream_broken"]
    assert breaker.snapshot()["error_ratio"] == 0.5


async def test_shutdown_with_a_hung_upstream_answers_503_after_the_drain_timeout(simulator, start_broker):
    broker = await start_broker({"providers": [provider_for(simulator)], **NO_MERGE_MODEL,
                                 "server": {"drain_timeout_s": 0.3}})
    simulator.set_faults(timeout_rate=1.0, hang_s=60)
    pending = asyncio.ensure_future(broker.chat("this upstream hangs"))
    # until the call is upstream (it is then in flight in the broker)
    await wait_until(lambda: simulator.stats()["chat_calls"], 5, "the call never reached the upstream")
    loop = asyncio.get_running_loop()
    started = loop.time()
    await broker.runner.cleanup()
    status, body, _ = await asyncio.wait_for(pending, 10)
    assert status == 503 and body["error"]["code"] == "shutting_down"
    assert loop.time() - started < 10  # not the hung call's read timeout
