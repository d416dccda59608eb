"""Cluster mode as real processes on loopback: two front-ends (`mergebroker serve`), two workers
(`mergebroker worker`), a real redis-server and the simulated upstream. A worker killed with SIGKILL in
the middle of a run loses nothing: its jobs are claimed and answered, each caller gets exactly one right
answer. With Redis gone the front-ends answer in-process, and they return to the cluster when it is back."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
import yaml
from prometheus_client.parser import text_string_to_metric_families

from mergebroker.broker.cluster.partition import GROUP
from mergebroker.providers.simulator.content import answer_for
from mergebroker.providers.simulator.faults import SimulatorConfig
from mergebroker.providers.simulator.server import start_simulator
from tests.conftest import RedisServer, free_port

# One cluster for the module (starting six processes is most of the time): the kill test runs first and
# leaves one worker, the outage test then runs on the survivor.
pytestmark = [pytest.mark.redis, pytest.mark.asyncio(loop_scope="module")]

CLUSTER = {"enabled": True, "partitions": 8, "claim_idle_ms": 1000, "lease_ms": 600, "block_ms": 200}
CALL_S = 0.5  # the simulated upstream's latency: long enough to kill a worker in the middle of calls
SYSTEMS = [f"You are assistant number {i}. Answer briefly." for i in range(8)]  # 8 merge keys over the partitions


class Child:
    """A broker process on a loopback port; its output goes to a log file shown when a test fails."""

    def __init__(self, args: list[str], port: int) -> None:
        self.port = port
        self.log = Path(tempfile.mkdtemp(prefix="mb-cluster-")) / "out.log"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "mergebroker.broker.cli", *args],
                                     stdout=self.log.open("wb"), stderr=subprocess.STDOUT, env=env)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


async def wait_ready(session: aiohttp.ClientSession, child: Child, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert child.proc.poll() is None, child.tail()
        try:
            async with session.get(child.url + "/readyz") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)  # polling a child process's readiness: there is no event to wait on
    pytest.fail(f"{child.url} not ready:\n{child.tail()}")


async def wait_for_lease_holders(url: str, count: int, timeout_s: float = 30) -> None:
    """Wait until `count` workers hold partitions (they share them after their first lease rounds)."""
    client = aioredis.from_url(url)
    deadline = time.monotonic() + timeout_s
    try:
        while len({await client.get(key) async for key in client.scan_iter(match="{mb:cluster}:lease:*")}) < count:
            assert time.monotonic() < deadline, "the workers never shared the partitions"
            await asyncio.sleep(0.05)  # watching other processes' state in Redis: no event to wait on
    finally:
        await client.aclose()


async def metric(session: aiohttp.ClientSession, child: Child, name: str) -> float:
    async with session.get(child.url + "/metrics") as resp:
        text = await resp.text()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


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
    config = {"providers": [{"name": "sim", "base_url": sim.url}], "redis": {"url": redis_server.url},
              "cluster": CLUSTER, "merge": {"embedder": "none"}, "logging": {"level": "info"}}
    path = Path(tempfile.mkdtemp(prefix="mb-cluster-cfg-")) / "config.yaml"
    children: list[Child] = []

    def spawn(kind: str) -> Child:
        port = free_port()
        if kind == "worker":
            args = ["worker", "--config", str(path), "--metrics-port", str(port)]
        else:
            args = ["serve", "--config", str(path), "--port", str(port)]
        children.append(Child(args, port))
        return children[-1]

    path.write_text(yaml.safe_dump(config))
    workers = [spawn("worker"), spawn("worker")]
    frontends = [spawn("serve"), spawn("serve")]
    session = aiohttp.ClientSession()
    try:
        for child in workers + frontends:
            await wait_ready(session, child)
        await wait_for_lease_holders(redis_server.url, 2)
        for fe in frontends:  # a front-end up before the workers serves locally until its next probe sees them
            deadline = time.monotonic() + 30
            while await metric(session, fe, "mergebroker_cluster_fallback") != 0:
                assert time.monotonic() < deadline, fe.tail()
                await asyncio.sleep(0.05)  # another process's state: no event to wait on
        yield {"sim": sim, "workers": workers, "frontends": frontends, "session": session}
    finally:
        await session.close()
        for child in children:
            child.stop()
        await sim.close()


async def ask(session: aiohttp.ClientSession, frontend: Child, system: str, question: str) -> tuple[int, str, float]:
    body = {"model": "sim-small", "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    started = time.monotonic()
    async with session.post(frontend.url + "/v1/chat/completions", json=body,
                            headers={"X-Broker-Tier": "batch"}) as resp:
        data = await resp.json()
    content = data["choices"][0]["message"]["content"] if resp.status == 200 else str(data)
    return resp.status, content, time.monotonic() - started


async def consumers_holding(url: str) -> set[str]:
    """Workers (consumer names) holding jobs now, read from the streams' pending lists."""
    client = aioredis.from_url(url)
    try:
        holders: set[str] = set()
        async for key in client.scan_iter(match="{mb:cluster}:jobs:*"):
            for entry in await client.xpending_range(key, GROUP, "-", "+", 100):
                holders.add(entry["consumer"].decode())
        return holders
    finally:
        await client.aclose()


async def test_kill_9_of_a_worker_mid_run_loses_nothing_and_answers_each_caller_once(cluster, redis_server):
    session, (w1, w2), frontends = cluster["session"], cluster["workers"], cluster["frontends"]
    questions = [(SYSTEMS[i % len(SYSTEMS)], f"Question {i}: what is the capital of country {i}?") for i in range(48)]
    calls = [asyncio.ensure_future(ask(session, frontends[i % 2], s, q)) for i, (s, q) in enumerate(questions)]
    victim = f"-{w1.proc.pid}-"
    deadline = time.monotonic() + 20
    while not any(victim in c for c in await consumers_holding(redis_server.url)):
        assert time.monotonic() < deadline, "the first worker never held a job"
        await asyncio.sleep(0.02)  # watching another process's state in Redis: no event to wait on
    w1.proc.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    results = await asyncio.wait_for(asyncio.gather(*calls), 60)
    finished = time.monotonic()
    assert [status for status, _c, _l in results] == [200] * len(questions), [r for r in results if r[0] != 200]
    assert [content for _s, content, _l in results] == [answer_for(q) for _s, q in questions]  # right, once each
    assert await metric(session, w2, "mergebroker_cluster_claims_total") >= 1
    for fe in frontends:
        assert await metric(session, fe, "mergebroker_cluster_fallback") == 0
    # Orphans: claimed after claim_idle_ms, then one upstream call (a merge window too); slack for a loaded machine.
    assert finished - killed_at < CLUSTER["claim_idle_ms"] / 1000 + CALL_S + 0.25 + 8


async def test_frontends_merge_in_process_while_redis_is_down_and_return_when_it_is_back(cluster, redis_server):
    session, frontends = cluster["session"], cluster["frontends"]
    workers = [w for w in cluster["workers"] if w.proc.poll() is None]  # the kill test's survivor
    assert (await ask(session, frontends[0], SYSTEMS[0], "Before the outage?"))[:2] == (200, answer_for("Before the outage?"))
    redis_server.stop()
    status, content, _ = await ask(session, frontends[0], SYSTEMS[0], "During the outage?")
    assert (status, content) == (200, answer_for("During the outage?"))
    assert await metric(session, frontends[0], "mergebroker_cluster_fallback") == 1
    redis_server.start()  # the same port, empty: the streams and leases are made again
    deadline = time.monotonic() + 30
    while await metric(session, frontends[0], "mergebroker_cluster_fallback") == 1:
        assert time.monotonic() < deadline, frontends[0].tail()
        await asyncio.sleep(0.1)  # the front-end probes Redis every fallback_probe_s
    answered = sum([await metric(session, w, "mergebroker_cluster_jobs_total") for w in workers])
    status, content, _ = await ask(session, frontends[0], SYSTEMS[1], "After the outage?")
    assert (status, content) == (200, answer_for("After the outage?"))
    assert sum([await metric(session, w, "mergebroker_cluster_jobs_total") for w in workers]) == answered + 1, (
        frontends[0].tail() + workers[0].tail() + workers[1].tail())
