"""Cluster failures as real processes at the default cluster timings (two front-ends, two workers, a real
redis-server, the simulated upstream): a paused worker (SIGSTOP) and a Redis kill run no job upstream
twice and give each caller one right answer, no warning outlives the Redis outage, and the jobs of a
worker killed with kill -9 are answered within 2 s plus their own upstream call."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
import yaml
from prometheus_client.parser import text_string_to_metric_families

from mergebroker.broker.engine.ground.settings import default_tiers
from mergebroker.providers.simulator.content import answer_for
from mergebroker.providers.simulator.faults import SimulatorConfig
from mergebroker.providers.simulator.server import start_simulator
from tests.broker.cluster.test_cluster_processes import (
    SYSTEMS,
    Child,
    ask,
    consumers_holding,
    metric,
    wait_for_lease_holders,
    wait_ready,
)
from tests.conftest import RedisServer, free_port

# One cluster for the module, its tests in order: the pause and the Redis kill need both workers, the kill -9
# leaves one.
pytestmark = [pytest.mark.redis, pytest.mark.asyncio(loop_scope="module")]

CLUSTER = {"enabled": True, "partitions": 8}  # claim_idle_ms, lease_ms and block_ms at their defaults
CALL_S = 1.0  # the simulated upstream's latency: jobs are in flight when a worker stops
WINDOW_S = 0.25  # the batch tier's merge window
ORPHANS_S = 2.0  # the goal: a dead worker's jobs answered this long after the kill, plus their own call
LOADED_HOST_SLACK_S = 0.5


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    yield server
    server.stop()
    shutil.rmtree(server.dir, ignore_errors=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(redis_server):
    sim = await start_simulator(SimulatorConfig(latency_base_ms=CALL_S * 1000))
    tiers = [t.model_dump() | ({"window_ms": WINDOW_S * 1000} if t.name == "batch" else {}) for t in default_tiers()]
    config = {"providers": [{"name": "sim", "base_url": sim.url}], "redis": {"url": redis_server.url},
              "cluster": CLUSTER, "tiers": tiers, "merge": {"embedder": "none"}, "logging": {"level": "info"}}
    path = Path(tempfile.mkdtemp(prefix="mb-failures-cfg-")) / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    workers = [Child(["worker", "--config", str(path), "--metrics-port", str(port)], port)
               for port in (free_port(), free_port())]
    frontends = [Child(["serve", "--config", str(path), "--port", str(port)], port) for port in (free_port(), free_port())]
    session = aiohttp.ClientSession()
    try:
        for child in workers + frontends:
            await wait_ready(session, child)
        await wait_for_lease_holders(redis_server.url, 2)
        for fe in frontends:
            await until(lambda fe=fe: metric(session, fe, "mergebroker_cluster_fallback"), 0)
        yield {"sim": sim, "workers": workers, "frontends": frontends, "session": session}
    finally:
        await session.close()
        for child in workers + frontends:
            child.stop()
        await sim.close()


async def until(read, value: float, timeout_s: float = 30.0) -> None:
    """Wait until `await read()` equals `value` (another process's state: polled, there is no event)."""
    deadline = time.monotonic() + timeout_s
    while await read() != value:
        assert time.monotonic() < deadline, f"still not {value}"
        await asyncio.sleep(0.05)


async def total(session, children, name: str) -> float:
    return sum([await metric(session, c, name) for c in children])


async def answered(session, workers) -> float:
    """Entries the workers answered (each caller's job counts once per worker that ran it)."""
    count = 0.0
    for worker in workers:
        async with session.get(worker.url + "/metrics") as resp:
            text = await resp.text()
        count += sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                     if s.name == "mergebroker_cluster_jobs_total" and s.labels.get("outcome") == "answered")
    return count


async def holding(url: str, *workers: Child, timeout_s: float = 20.0) -> None:
    """Wait until one of `workers` holds jobs (read from the streams' pending lists: no event to wait on)."""
    deadline = time.monotonic() + timeout_s
    while not any(f"-{w.proc.pid}-" in c for c in await consumers_holding(url) for w in workers):
        assert time.monotonic() < deadline, "no worker ever held a job"
        await asyncio.sleep(0.02)


def questions(tag: str, n: int = 48) -> list[tuple[str, str]]:
    return [(SYSTEMS[i % len(SYSTEMS)], f"{tag} question {i}: what is the capital of country {i}?") for i in range(n)]


def right_once(results, asked) -> None:
    assert [status for status, _c, _l in results] == [200] * len(asked), [r for r in results if r[0] != 200]
    assert [content for _s, content, _l in results] == [answer_for(q) for _s, q in asked]


async def test_a_paused_worker_runs_no_job_twice_and_each_caller_gets_one_right_answer(cluster, redis_server):
    session, (w1, _w2), frontends = cluster["session"], cluster["workers"], cluster["frontends"]
    before = await answered(session, cluster["workers"])
    first, second = questions("Before the pause"), questions("Just before the pause", 24)
    calls = [asyncio.ensure_future(ask(session, frontends[i % 2], s, q)) for i, (s, q) in enumerate(first)]
    await holding(redis_server.url, w1)
    await asyncio.sleep(WINDOW_S + 0.2)  # the scenario: its merge windows closed, its calls are upstream
    calls += [asyncio.ensure_future(ask(session, frontends[i % 2], s, q)) for i, (s, q) in enumerate(second)]
    await asyncio.sleep(0.1)  # the scenario: the second wave is read and waits in merge windows when w1 stops
    w1.proc.send_signal(signal.SIGSTOP)
    try:
        await asyncio.sleep(8.0)  # the scenario: paused past lease_ms and claim_idle_ms (3 s, 5 s by default)
    finally:
        w1.proc.send_signal(signal.SIGCONT)
    results = await asyncio.wait_for(asyncio.gather(*calls), 60)
    right_once(results, first + second)
    await asyncio.sleep(CALL_S + 1.0)  # the scenario: a second run of any job would have answered by now
    assert await total(session, frontends, "mergebroker_cluster_duplicates_dropped_total") == 0
    # Each job answered by exactly one worker: none ran upstream twice.
    assert await answered(session, cluster["workers"]) == before + len(first) + len(second)


async def test_a_redis_kill_runs_no_job_twice_and_no_warning_outlives_it(cluster, redis_server):
    session, workers, frontends = cluster["session"], cluster["workers"], cluster["frontends"]
    dropped = await total(session, frontends, "mergebroker_cluster_duplicates_dropped_total")
    asked = questions("During the Redis kill")
    calls = [asyncio.ensure_future(ask(session, frontends[i % 2], s, q)) for i, (s, q) in enumerate(asked)]
    await holding(redis_server.url, *workers)
    await asyncio.sleep(WINDOW_S + 0.2)  # the scenario: Redis dies while the jobs are upstream
    redis_server.proc.kill()  # SIGKILL: the streams, leases and markers are lost
    redis_server.proc.wait()
    redis_server.proc = None
    redis_server.start()
    done, pending = await asyncio.wait(calls, timeout=60)
    assert not pending, "\n".join(c.tail() for c in workers + frontends)
    right_once([c.result() for c in calls], asked)
    await asyncio.sleep(CALL_S + 1.0)  # the scenario: a second run of any job would have answered by now
    assert await total(session, frontends, "mergebroker_cluster_duplicates_dropped_total") == dropped, (
        "\n".join(c.tail() for c in workers + frontends))
    for fe in frontends:
        await until(lambda fe=fe: metric(session, fe, "mergebroker_cluster_fallback"), 0)
    after = questions("After the Redis kill", 16)
    right_once(await asyncio.gather(*(ask(session, frontends[i % 2], s, q) for i, (s, q) in enumerate(after))), after)
    for child in workers + frontends:
        assert late_warnings(child) == [], child.tail()


def late_warnings(child: Child) -> list[str]:
    """Cluster warnings and errors a process logged after it last saw Redis come back."""
    events = []
    for line in child.log.read_text(errors="replace").splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    recovered = max((i for i, e in enumerate(events) if e.get("event") in ("cluster_redis_recovered",
                                                                            "cluster_resumed")), default=-1)
    return [e["event"] for e in events[recovered + 1:] if e.get("level") in ("warning", "error")
            and str(e.get("event", "")).startswith("cluster_")]


async def test_a_killed_workers_jobs_are_answered_within_2_s_plus_their_call_at_the_defaults(cluster, redis_server):
    session, (w1, w2), frontends = cluster["session"], cluster["workers"], cluster["frontends"]
    asked = questions("Around the kill")
    sent_at = time.monotonic()
    calls = [asyncio.ensure_future(ask(session, frontends[i % 2], s, q)) for i, (s, q) in enumerate(asked)]
    deadline = time.monotonic() + 20
    while not any(f"-{w1.proc.pid}-" in c for c in await consumers_holding(redis_server.url)):
        assert time.monotonic() < deadline, "the first worker never held a job"
        await asyncio.sleep(0.02)  # another process's state: no event to wait on
    w1.proc.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    results = await asyncio.wait_for(asyncio.gather(*calls), 60)
    right_once(results, asked)
    latest = max(sent_at + latency for _s, _c, latency in results)
    assert latest - killed_at - CALL_S <= ORPHANS_S + LOADED_HOST_SLACK_S
    assert await metric(session, w2, "mergebroker_cluster_claims_total") >= 1
