"""Cluster-mode benchmark: the same batch-tier workload through one replica, N replicas, and the cluster.

Every configuration gets the same Poisson arrivals (100 req/s by default) of the merge benchmark's mixed
workload on the batch tier, spread round-robin over its front-ends, against one simulated upstream:
one replica (in-process merging, the baseline); 2 and 4 replicas each merging what it receives
(per-replica mode); 2 front-ends + 2 workers on Redis Streams (cluster mode); the cluster again with
one of the two workers killed (SIGKILL) halfway through. A passthrough run (no merging, no cache) gives
the cost of every request sent alone. The in-process and cluster runs are then repeated side by side
(`latency_rounds` pairs, alternating which runs first): the latency the cluster adds is the median of the
pairs' differences, since one run's p99 rests on a handful of merged calls. Every process is real and every configuration shares one Redis
(flushed between runs), as replicas share it in production. `python -m bench.cluster [--quick]`
writes `bench/results/cluster.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis
import yaml

from bench.harness import (
    CpuWindow,
    Process,
    TimedSample,
    _spawn,
    _wait_http,
    cpu_probe_ms,
    free_port,
    latency_summary,
    open_loop,
    post_json,
    processes_together,
    run_meta,
    start_simulator,
    write_results,
)
from bench.merging import SIM_OPTIONS, RunSpec, body_source, broker_config, scrape, total
from bench.workloads import ChatItem, mixed_workload
from mergebroker.broker.cluster.partition import GROUP

RESULTS_PATH = Path(__file__).parent / "results" / "cluster.json"
TIER = "batch"
CLUSTER = {"enabled": True, "partitions": 64}  # claim_idle_ms, lease_ms, block_ms: the shipped defaults
CLUSTER_PREFIX = "mb:cluster"  # the default `cluster.prefix`


@dataclass(frozen=True)
class Plan:
    """Sizes: the arrival rate and how long each configuration runs."""

    rate: float = 100.0
    duration_s: float = 8.0
    latency_rounds: int = 5  # paired in-process / cluster runs whose latency differences are compared


FULL_PLAN = Plan()
QUICK_PLAN = Plan(duration_s=2.0, latency_rounds=1)


@dataclass(frozen=True)
class Layout:
    """One configuration: how many front-ends (replicas) and workers, merging on or off, a worker killed or not."""

    name: str
    frontends: int
    workers: int = 0  # 0: each front-end merges in-process
    merge: bool = True
    kill_worker: bool = False


SINGLE = Layout("1 replica (in-process)", 1)
CLUSTER_LAYOUT = Layout("cluster: 2 front-ends + 2 workers", 2, workers=2)
LAYOUTS = (Layout("passthrough, 1 replica", 1, merge=False), SINGLE,
           Layout("2 replicas (per-replica)", 2), Layout("4 replicas (per-replica)", 4), CLUSTER_LAYOUT,
           Layout("cluster, kill -9 of 1 of 2 workers", 2, workers=2, kill_worker=True))


async def start_redis() -> Process:
    """A redis-server on a free loopback port, nothing persisted."""
    port = free_port()
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (scripts/setup.sh --with-redis installs it)")
    proc, log = _spawn([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                       "redis")
    client = aioredis.Redis(port=port)
    try:
        for _ in range(200):
            with contextlib.suppress(Exception):
                if await client.ping():
                    return Process(proc, port, log)
            await asyncio.sleep(0.05)  # polling a child process's port: no event to wait on
    finally:
        await client.aclose()
    raise RuntimeError("redis-server did not start")


async def _start(kind: str, config: dict[str, Any]) -> Process:
    """`mergebroker serve` or `mergebroker worker` with `config` on a free port; waits for /readyz."""
    port = free_port()
    path = Path(tempfile.mkdtemp(prefix="mb-bench-cfg-")) / "config.yaml"
    path.write_text(yaml.safe_dump({**config, "logging": {"level": "warning"}}))
    args = ["worker", "--metrics-port", str(port)] if kind == "worker" else ["serve", "--port", str(port)]
    proc, log = _spawn([sys.executable, "-m", "mergebroker.broker.cli", *args, "--config", str(path)], kind)
    p = Process(proc, port, log)
    await _wait_http(p.url + "/readyz")
    return p


@contextlib.asynccontextmanager
async def deployed(layout: Layout, sim_url: str, redis_url: str) -> AsyncIterator[tuple[list[Process], list[Process]]]:
    """The layout's processes, started together (start-up is mostly imports), stopped on exit."""
    config = {**broker_config(sim_url, RunSpec(layout.name, TIER, merge=layout.merge)), "redis": {"url": redis_url}}
    if not layout.merge:
        config["cache"] = {"enabled": False}
    if layout.workers:
        config["cluster"] = CLUSTER
    starters = [_start("worker", config) for _ in range(layout.workers)]
    starters += [_start("serve", config) for _ in range(layout.frontends)]
    async with processes_together(*starters) as started:
        yield started[:layout.workers], started[layout.workers:]


async def _in_cluster_mode(frontends: list[Process], timeout_s: float = 60.0) -> None:
    """Wait until every front-end sends to the workers: one up before them serves locally until its next probe."""
    deadline = time.monotonic() + timeout_s
    for frontend in frontends:
        while total(await scrape(frontend.url), "mergebroker_cluster_fallback") != 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{frontend.url} stayed in its in-process fallback")
            await asyncio.sleep(0.1)  # another process's state: no event to wait on


def checked_request(url: str, items: Sequence[ChatItem]) -> Any:
    """Like `chat_request(tolerant=True)`, keeping the answer's text (`body["content"]`) to check it against the tag."""
    body_for = body_source(items, TIER)

    async def send(session: aiohttp.ClientSession, i: int) -> TimedSample:
        body, headers, tag = body_for(i)
        started = time.perf_counter()
        try:
            async with session.post(url + "/v1/chat/completions", json=body, headers=headers,
                                    timeout=aiohttp.ClientTimeout(total=120)) as resp:
                data = await resp.json(content_type=None)
                status = resp.status
                overhead_ms = float(resp.headers.get("X-Broker-Overhead-Ms") or "nan")
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            return TimedSample(time.perf_counter() - started, 0, tag=tag, sent_at=started,
                               error_code=f"transport:{type(exc).__name__}")
        content = None
        with contextlib.suppress(TypeError, KeyError, IndexError):
            content = data["choices"][0]["message"]["content"]
        latency_s = time.perf_counter() - started
        # The upstream call that answered it: its latency less the broker's own time (what the header says).
        upstream_s = max(0.0, latency_s - overhead_ms / 1000) if overhead_ms == overhead_ms else None
        return TimedSample(latency_s, status, body={"content": content, "upstream_s": upstream_s}, tag=tag,
                           sent_at=started)

    return send


def histogram_quantile(buckets: dict[float, float], q: float) -> float | None:
    """Prometheus's `histogram_quantile` over cumulative bucket counts {le: count} (linear inside a bucket)."""
    edges = sorted(buckets)
    count = buckets[edges[-1]] if edges else 0
    if not count:
        return None
    rank, lower, below = q * count, 0.0, 0.0
    for le in edges:
        if buckets[le] >= rank:
            if le == float("inf"):
                return lower
            return lower + (le - lower) * (rank - below) / max(buckets[le] - below, 1e-9)
        lower, below = le, buckets[le]
    return lower


def hop_buckets(before: list[Any], after: list[Any]) -> dict[float, float]:
    """The front-ends' `cluster_hop_seconds` buckets, summed over front-ends, grown during the run."""
    name = "mergebroker_cluster_hop_seconds_bucket"
    edges = {float(dict(labels)["le"]) for scrape_ in after for (n, labels) in scrape_ if n == name}
    return {le: sum(total(a, name, le=_le(le)) - total(b, name, le=_le(le)) for a, b in zip(after, before))
            for le in edges}


def _le(value: float) -> str:
    return "+Inf" if value == float("inf") else repr(value)


async def kill_after(workers: list[Process], redis_url: str, delay_s: float) -> tuple[float, int]:
    """After `delay_s`, SIGKILL the worker holding the most jobs; when (perf_counter), and how many it held."""
    await asyncio.sleep(delay_s)  # the scenario's own timeline
    client = aioredis.Redis.from_url(redis_url)
    held: dict[int, int] = {}
    try:
        async for key in client.scan_iter(match=f"{CLUSTER_PREFIX}:jobs:*"):
            for entry in await client.xpending_range(key, GROUP, "-", "+", 1000):
                pid = int(entry["consumer"].decode().split("-")[-2])  # worker IDs are host-pid-random
                held[pid] = held.get(pid, 0) + 1
    finally:
        await client.aclose()
    victim = max(workers, key=lambda w: held.get(w.proc.pid, 0))
    victim.proc.send_signal(signal.SIGKILL)
    return time.perf_counter(), held.get(victim.proc.pid, 0)


async def measure(layout: Layout, plan: Plan, sim: Process, redis_url: str,
                  items: Sequence[ChatItem]) -> dict[str, Any]:
    """One layout's run: answers checked, upstream cost from the simulator, latency, cluster counters."""
    client = aioredis.Redis.from_url(redis_url)
    await client.flushall()
    await client.aclose()
    async with deployed(layout, sim.url, redis_url) as (workers, frontends):
        if workers:
            await _in_cluster_mode(frontends)
        sends = [checked_request(f.url, items) for f in frontends]
        warm = [ChatItem("support", f"Warm-up question {i}: is the service answering?", "warmup") for i in range(8)]
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(checked_request(f.url, warm)(session, i) for f in frontends for i in range(8)))
        await post_json(sim.url + "/stats/reset", {})
        before = [await scrape(f.url) for f in frontends]
        cpu = [CpuWindow(p) for p in workers + frontends]
        killer = (asyncio.ensure_future(kill_after(workers, redis_url, plan.duration_s / 2)) if layout.kill_worker
                  else None)
        samples, wall_s = await open_loop(lambda s, i: sends[i % len(sends)](s, i), rate=plan.rate, total=len(items))
        cpu_s = sum(c.seconds() for c in cpu if c.process.proc.poll() is None)
        after = [await scrape(f.url) for f in frontends]
        survivors = [await scrape(w.url) for w in workers if w.proc.poll() is None]
        async with aiohttp.ClientSession() as session:
            async with session.get(sim.url + "/stats") as resp:
                sim_stats = await resp.json()
    kill_at, victim_held = killer.result() if killer else (None, 0)
    return {**summarize(layout, samples, wall_s, sim_stats, before, after, survivors, kill_at),
            "broker_cpu_ms_per_request": 1000 * cpu_s / len(samples) if samples else 0.0,
            "killed_worker_held": victim_held}


def summarize(layout: Layout, samples: list[Any], wall_s: float, sim_stats: dict[str, Any], before: list[Any],
              after: list[Any], workers: list[Any], kill_at: float | None) -> dict[str, Any]:
    """The figures of one run."""
    n = len(samples)
    lat = [s.latency_s * 1000 for s in samples]
    hop = hop_buckets(before, after)
    pre_kill = [s for s in samples if kill_at is not None and s.sent_at < kill_at]
    return {
        **asdict(layout), "requests": n, "wall_s": round(wall_s, 2),
        "errors": sum(1 for s in samples if s.status != 200),
        "wrong_answers": sum(1 for s in samples if s.status == 200 and (s.body or {}).get("content") != s.tag),
        "upstream_calls": sim_stats["chat_calls"], "merged_calls": sim_stats["merged_calls"],
        "calls_per_request": sim_stats["chat_calls"] / n if n else 0.0,
        "prompt_tokens_per_request": sim_stats["prompt_tokens"] / n if n else 0.0,
        **latency_summary(lat),
        "hop_p50_ms": _ms(histogram_quantile(hop, 0.5)), "hop_p99_ms": _ms(histogram_quantile(hop, 0.99)),
        "hop_count": hop.get(float("inf"), 0.0),
        "duplicates_dropped": sum(total(a, "mergebroker_cluster_duplicates_dropped_total") for a in after)
        - sum(total(b, "mergebroker_cluster_duplicates_dropped_total") for b in before),
        "fallback_transitions": sum(total(a, "mergebroker_cluster_fallback_transitions_total") for a in after),
        "claims": sum(total(w, "mergebroker_cluster_claims_total") for w in workers),
        "leases_lost": sum(total(w, "mergebroker_cluster_lease_changes_total", event="lost") for w in workers),
        "orphans_answered_after_kill_s": (max(s.sent_at + s.latency_s for s in pre_kill) - kill_at
                                          if pre_kill and kill_at is not None else None),
        "orphans_answered_after_kill_less_call_s": _orphans_less_call(pre_kill, kill_at),
    }


def _orphans_less_call(pre_kill: list[Any], kill_at: float | None) -> float | None:
    """For requests sent before the kill and answered after it: the latest answer after the kill, less the
    upstream call that answered it (so what is left is detection, claim and the trip back)."""
    if kill_at is None:
        return None
    late = [s.done_at - kill_at - ((s.body or {}).get("upstream_s") or 0.0) for s in pre_kill if s.done_at > kill_at]
    return max(late) if late else 0.0


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


async def run_cluster(plan: Plan = FULL_PLAN, *, on_run: Any = None) -> dict[str, Any]:
    """Every layout with the same arrivals, as the JSON-ready dict written to `cluster.json`."""
    started, probe = time.perf_counter(), cpu_probe_ms()
    items = mixed_workload(round(plan.rate * plan.duration_s), seed=4)
    sim = await start_simulator(*SIM_OPTIONS)
    redis = await start_redis()
    runs, url = {}, f"redis://127.0.0.1:{redis.port}/0"
    try:
        for layout in LAYOUTS:
            runs[layout.name] = await measure(layout, plan, sim, url, items)
            if on_run:
                on_run(layout.name)
        pairs = [_latency_pair(runs[SINGLE.name], runs[CLUSTER_LAYOUT.name])]
        for round_no in range(1, plan.latency_rounds):  # more pairs, each side by side, order alternating
            order = (CLUSTER_LAYOUT, SINGLE) if round_no % 2 else (SINGLE, CLUSTER_LAYOUT)
            again = {layout.name: await measure(layout, plan, sim, url, items) for layout in order}
            pairs.append(_latency_pair(again[SINGLE.name], again[CLUSTER_LAYOUT.name]))
            if on_run:
                on_run(f"latency round {round_no + 1}")
        try:
            floor = await hop_floor(url, rate=plan.rate, count=len(items))
        except RuntimeError as exc:
            floor = {"error": str(exc)}
    finally:
        sim.stop()
        redis.stop()
    return {"plan": asdict(plan), "cluster": CLUSTER, "tier": TIER, "simulator_options": list(SIM_OPTIONS),
            "runs": runs, "latency_pairs": pairs, "hop_floor": floor, "meta": run_meta(started, probe)}


def _latency_pair(single: dict[str, Any], cluster: dict[str, Any]) -> dict[str, float]:
    """One side-by-side pair: each run's p50/p99 and the cluster's difference."""
    return {"single_p50_ms": single["p50_ms"], "single_p99_ms": single["p99_ms"],
            "cluster_p50_ms": cluster["p50_ms"], "cluster_p99_ms": cluster["p99_ms"],
            "added_p50_ms": cluster["p50_ms"] - single["p50_ms"], "added_p99_ms": cluster["p99_ms"] - single["p99_ms"]}


class EchoQueue:
    """A worker-side `JobQueue` that answers every job at once: what is left of a round trip is the hop."""

    def submit(self, job: Any) -> Any:
        from mergebroker.broker.engine.chat.jobs import ChatOutcome

        asyncio.get_running_loop().call_soon(job.resolve, ChatOutcome({"choices": []}, "echo", 0.0))
        return job.future

    def run_now(self, job: Any) -> None:
        return None

    def depth(self, tier: str) -> int:
        return 0

    def start(self) -> None:
        """Nothing to start."""

    async def stop(self) -> None:
        """Nothing to stop."""

    def alive(self) -> bool:
        return True


async def hop_floor(redis_url: str, *, rate: float, count: int, **overrides: Any) -> dict[str, Any]:
    """The hop alone: a front-end queue and a worker consumer in this one process, no HTTP, no upstream.

    Jobs arrive at `rate` (Poisson) and are answered as soon as the worker reads them, so each round
    trip is the Redis mechanism (add, read, reply, read) plus this process's own scheduling.
    """
    import random

    from mergebroker.broker.engine.chat.jobs import ChatJob
    from mergebroker.broker.engine.limits.admission import Caller

    frontend, worker, leases, worker_redis = _echo_pair(redis_url, **overrides)
    started = time.monotonic()
    while not leases.owned:
        if time.monotonic() - started > 30:
            for task in asyncio.all_tasks():
                task.print_stack(limit=4, file=sys.stderr)
            raise RuntimeError("hop floor: the worker never acquired a partition")
        await asyncio.sleep(0.01)  # the first lease round
    rng, latencies = random.Random(5), []

    async def one(i: int) -> None:
        now = time.perf_counter()
        job = ChatJob(request_id=f"r{i}", caller=Caller("t", TIER), body={"model": "m", "messages": []}, model="m",
                      priority=0.0, shape=None, merge_key=f"k{i}", prompt_tokens=1, max_tokens=1,
                      deadline=time.monotonic() + 30, enqueued_at=time.monotonic())
        await frontend.submit(job)
        latencies.append((time.perf_counter() - now) * 1000)

    try:
        tasks = []
        for i in range(count):
            await asyncio.sleep(rng.expovariate(rate))  # the arrival process itself
            tasks.append(asyncio.ensure_future(one(i)))
        _done, pending = await asyncio.wait(tasks, timeout=60)
        if pending:  # a lost job: say so in the results instead of hanging the benchmark
            print(f"hop floor: {len(pending)} jobs unanswered; front-end waiting {len(frontend._waiting)}, "
                  f"worker holds {worker._consumer.held}, leases {len(leases.owned)}", file=sys.stderr, flush=True)
            for task in pending:
                task.cancel()
    finally:
        await frontend.stop()
        await worker.stop()
        await worker_redis.aclose()
    return {"rate": rate, "jobs": count, "unanswered": count - len(latencies), **latency_summary(latencies)}


def _echo_pair(redis_url: str, **overrides: Any) -> tuple[Any, Any, Any, Any]:
    """A started front-end queue and a started worker (answering with `EchoQueue`) on `redis_url`."""
    from mergebroker.broker.cluster.client import make_stream_client
    from mergebroker.broker.cluster.consumer import StreamConsumer
    from mergebroker.broker.cluster.frontend import ClusterQueue
    from mergebroker.broker.cluster.leases import PartitionLeases
    from mergebroker.broker.cluster.partition import Keys
    from mergebroker.broker.cluster.server_time import ServerClock
    from mergebroker.broker.cluster.worker import ClusterWorker
    from mergebroker.broker.engine.ground.metrics import Metrics
    from mergebroker.broker.engine.ground.settings import ClusterSettings, default_tiers

    settings = ClusterSettings(**{**CLUSTER, "claim_idle_ms": 1000, "lease_ms": 600, "block_ms": 1000, **overrides})
    keys, server_clock, metrics = Keys("mb:floor"), ServerClock(), Metrics()
    worker_redis, frontend_redis = (make_stream_client(redis_url, block_ms=settings.block_ms) for _ in range(2))
    leases = PartitionLeases(worker_redis, keys, "floor", partitions=settings.partitions, lease_ms=settings.lease_ms,
                             server_clock=server_clock)
    consumer = StreamConsumer(worker_redis, EchoQueue(), keys=keys, settings=settings,  # type: ignore[arg-type]
                              tiers=default_tiers(), leases=leases, server_clock=server_clock, consumer_id="floor",
                              aging_per_s=10.0, metrics=metrics)
    worker = ClusterWorker(worker_redis, consumer, leases, keys=keys, settings=settings, metrics=metrics)
    frontend = ClusterQueue(frontend_redis, EchoQueue(), keys=keys, settings=settings,  # type: ignore[arg-type]
                            partitions=settings.partitions, server_clock=ServerClock(), metrics=Metrics(),
                            owns_client=True)
    worker.start()
    frontend.start()
    return frontend, worker, leases, worker_redis


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m bench.cluster [--quick] [--out FILE]`: run the cluster benchmark and write its JSON."""
    parser = argparse.ArgumentParser(prog="bench.cluster", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke-sized runs")
    parser.add_argument("--out", default=str(RESULTS_PATH), help="result file (default: %(default)s)")
    args = parser.parse_args(argv)
    results = asyncio.run(run_cluster(QUICK_PLAN if args.quick else FULL_PLAN,
                                      on_run=lambda name: print("done:", name, flush=True)))
    write_results(args.out, results)
    for name, run in results["runs"].items():
        print(f"{name}: calls/req {run['calls_per_request']:.3f} tokens/req {run['prompt_tokens_per_request']:.0f} "
              f"p50 {run['p50_ms']:.1f} p99 {run['p99_ms']:.1f} hop p50/p99 {run['hop_p50_ms']}/{run['hop_p99_ms']} "
              f"errors {run['errors']} wrong {run['wrong_answers']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
