"""Cluster mode across a Redis failover, as real processes (a front-end, a worker, the simulated upstream): over
Redis Sentinel (a master with its replica, three sentinels) and over a Redis Cluster (three masters with a
replica each), the master holding cluster mode's keys SIGKILLed in the middle of traffic loses no request,
every caller gets its own right answer, no job goes upstream twice, and the cluster resumes on the promoted
replica."""

from __future__ import annotations

import asyncio
import re
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from mergebroker.merge.redis_cache import make_redis_client
from mergebroker.providers.simulator.content import answer_for
from mergebroker.providers.simulator.faults import SimulatorConfig
from mergebroker.providers.simulator.server import start_simulator
from tests.broker.cluster.test_cluster_processes import SYSTEMS, Child, ask, metric, wait_ready
from tests.broker.cluster.test_redis_topologies import (  # noqa: F401 - fixtures
    FAILOVER_S,
    Processes,
    SentinelSet,
    cli,
    needs_binaries,
    owner_of,
    processes,
    replicated_cluster,
    sentinel_set,
)
from tests.conftest import free_port
from tests.helpers.polling import wait_until

pytestmark = [pytest.mark.redis]

CLUSTER = {"enabled": True, "partitions": 8, "claim_idle_ms": 1000, "lease_ms": 600, "block_ms": 200}
CALL_S = 0.3
QUESTION = re.compile(r"Question \d+: what is the capital of country \d+\?")


class UpstreamQuestions:
    """Counts, by question, how often each reached the upstream (a merged call carries several)."""

    def __init__(self, simulator: Any) -> None:
        self.seen: Counter[str] = Counter()
        record = simulator.record_request

        def counting(request: Any, body: Any) -> None:
            self.seen.update(QUESTION.findall(str(body)))
            record(request, body)

        simulator.record_request = counting


async def _partitions_held(url: str) -> bool:
    client = make_redis_client(url)
    try:
        return len([key async for key in client.scan_iter(match="{mb:cluster}:lease:*")]) == CLUSTER["partitions"]
    finally:
        await client.aclose()


@needs_binaries
async def test_a_sentinel_failover_in_cluster_mode_loses_nothing_sends_nothing_twice_and_resumes(
        sentinel_set: SentinelSet) -> None:  # noqa: F811 - the fixture imported above
    await _failover_under_traffic(sentinel_set.url, lambda: sentinel_set.processes.kill(sentinel_set.master))
    assert sentinel_set.master_port() == sentinel_set.replica


@needs_binaries
async def test_a_redis_cluster_master_failure_in_cluster_mode_loses_nothing_sends_nothing_twice_and_resumes(
        processes: Processes) -> None:  # noqa: F811 - the fixture imported above
    ports = replicated_cluster(processes)
    slot = int(cli(ports[0], "CLUSTER", "KEYSLOT", "{mb:cluster}").strip())
    master = owner_of(ports, slot)  # cluster mode's every key is in this slot
    await _failover_under_traffic("redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports),
                                  lambda: processes.kill(master))
    assert owner_of([p for p in ports if p != master], slot) != master  # its replica took over


async def _failover_under_traffic(url: str, kill: Callable[[], None]) -> None:
    """A front-end and a worker on `url`; 60 questions at an open-loop pace with `kill` after the 21st: every
    caller gets its own right answer, none reached the upstream twice, and jobs go through the worker again
    within FAILOVER_S."""
    sim = await start_simulator(SimulatorConfig(latency_base_ms=CALL_S * 1000))
    upstream = UpstreamQuestions(sim._simulator)  # this process's simulator: what reached it, by question
    config = {"providers": [{"name": "sim", "base_url": sim.url}], "redis": {"url": url},
              "cluster": CLUSTER, "merge": {"embedder": "none"}}
    path = Path(tempfile.mkdtemp(prefix="mb-cluster-failover-")) / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    worker_port, frontend_port = free_port(), free_port()
    worker = Child(["worker", "--config", str(path), "--metrics-port", str(worker_port)], worker_port)
    frontend = Child(["serve", "--config", str(path), "--port", str(frontend_port)], frontend_port)
    session = aiohttp.ClientSession()
    try:
        for child in (worker, frontend):
            await wait_ready(session, child)
        await wait_until(lambda: _partitions_held(url), 30, "the worker never held the partitions")

        async def in_cluster() -> bool:
            return await metric(session, frontend, "mergebroker_cluster_fallback") == 0

        await wait_until(in_cluster, 30, lambda: frontend.tail())
        questions = [(SYSTEMS[i % len(SYSTEMS)], f"Question {i}: what is the capital of country {i}?")
                     for i in range(60)]
        calls: list[asyncio.Future[tuple[int, str, float]]] = []
        for i, (system, question) in enumerate(questions):
            calls.append(asyncio.ensure_future(ask(session, frontend, system, question)))
            if i == 20:
                kill()  # in the middle of traffic
            await asyncio.sleep(0.05)  # an open-loop client's pace: the traffic spans the failover
        try:
            results = await asyncio.wait_for(asyncio.gather(*calls), 90)
        except TimeoutError:
            pytest.fail("callers still waiting\n" + frontend.tail() + "\n---worker---\n" + worker.tail())
        assert [status for status, _c, _l in results] == [200] * len(questions), [r for r in results if r[0] != 200]
        assert [content for _s, content, _l in results] == [answer_for(q) for _s, q in questions]
        assert {q: n for q, n in upstream.seen.items() if n > 1} == {}  # mark, note and replication come first

        async def back_in_cluster() -> bool:
            status, content, _ = await ask(session, frontend, SYSTEMS[0], "After the failover?")
            return status == 200 and await in_cluster()

        started = time.monotonic()
        await wait_until(back_in_cluster, FAILOVER_S, lambda: frontend.tail() + worker.tail())
        jobs = await metric(session, worker, "mergebroker_cluster_jobs_total")
        status, _c, _l = await ask(session, frontend, SYSTEMS[1], "Through the worker again?")
        assert status == 200 and await metric(session, worker, "mergebroker_cluster_jobs_total") > jobs  # via the worker
        assert time.monotonic() - started < FAILOVER_S
        # The promoted master had none of the scripts: they are loaded before their first use there, not failed.
        assert "NoScriptError" not in worker.log.read_text(errors="replace")
    finally:
        await session.close()
        for child in (frontend, worker):
            child.stop()
        await sim.close()
