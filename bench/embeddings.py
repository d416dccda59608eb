"""Embeddings benchmark: the broker's local all-MiniLM-L6-v2 behind `/v1/embeddings`.

Three measurements, each against real broker processes:
1. throughput and p99 at concurrency 1, 16 and 64, window batching vs. one text per model call
   (`embeddings: {window_ms: 0, max_batch_size: 1}`), every text new so nothing comes from a cache;
2. cache latency: a miss, an L1 hit, and an L2 hit (Redis, a `redis-server` child process; the broker is
   restarted so its L1 is empty and the vector must come from Redis);
3. on a stream where 40 % of the texts repeat an earlier one, the share of texts that reach the model;
4. in this process, the similarity model's CPU per call and per text by batch size, float vs. int8 copy
   (`merge.embedder: local` vs. `local-int8`), on one torch thread as the broker runs it;
5. in this process, every similarity backend side by side (`bench.embedding_backends`): CPU per text and
   cosine drift against the float model, torch beside onnxruntime.
`python -m bench.embeddings [--quick]` writes `bench/results/embeddings.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis

from bench.embedding_backends import FULL_BACKEND_PLAN, QUICK_BACKEND_PLAN, BackendPlan
from bench.embedding_backends import run as run_backends
from bench.harness import (
    Process,
    RequestFn,
    Sample,
    closed_loop,
    cpu_probe_ms,
    free_port,
    off_loop_seconds,
    percentile,
    run_meta,
    start_broker,
    start_simulator,
    write_json,
)
from bench.merging import Metrics, delta, scrape
from bench.workloads import distinct_texts, with_repeats

RESULTS_PATH = Path(__file__).parent / "results" / "embeddings.json"
LOCAL_MODEL = "all-MiniLM-L6-v2"
L2_PREFIX = "emb:"  # the prefix broker/embeddings.py gives embedding vectors in Redis

OnStep = Callable[[str], None]


@dataclass(frozen=True)
class EmbeddingPlan:
    """Sizes of the embeddings benchmark; `QUICK_EMBEDDING_PLAN` is a smoke-sized copy."""

    concurrencies: tuple[int, ...] = (1, 16, 64)
    seconds_per_level: float = 4.0
    cache_texts: int = 100
    repeat_texts: int = 600
    repeat_share: float = 0.4
    repeat_concurrency: int = 16
    cost_batch_sizes: tuple[int, ...] = (1, 4, 16, 64)
    cost_texts: int = 64  # texts per batch size and model (at least 3 calls each)
    backends: BackendPlan = FULL_BACKEND_PLAN

    def step_count(self) -> int:
        """How many progress steps `run_embeddings` reports: two setups, the cache probe, the model cost, the
        backends."""
        return 5


FULL_EMBEDDING_PLAN = EmbeddingPlan()
QUICK_EMBEDDING_PLAN = EmbeddingPlan(concurrencies=(1, 16), seconds_per_level=1.0, cache_texts=10,
                                     repeat_texts=60, cost_batch_sizes=(1, 8), cost_texts=8,
                                     backends=QUICK_BACKEND_PLAN)


@dataclass(frozen=True)
class EmbeddingSetup:
    """One broker configuration for the throughput matrix."""

    name: str
    batching: bool


def embedding_config(sim_url: str, *, batching: bool, redis_url: str | None = None) -> dict[str, Any]:
    """Broker settings serving the local model; `batching=False` is the one-text-per-call baseline."""
    config: dict[str, Any] = {
        "providers": [{"name": "sim", "base_url": sim_url + "/v1"},
                      {"name": "local", "kind": "local", "models": [LOCAL_MODEL]}],
        "merge": {"embedder": "none"},  # only /v1/embeddings is measured; chat merging stays idle
    }
    if not batching:
        config["embeddings"] = {"window_ms": 0, "max_batch_size": 1}
    if redis_url:
        config["redis"] = {"url": redis_url}
    return config


def embedding_request(url: str, text_for: Callable[[int], str]) -> RequestFn:
    """A request function posting one text, `text_for(i)`, to `url`/v1/embeddings."""

    async def send(session: aiohttp.ClientSession, i: int) -> Sample:
        started = time.perf_counter()
        async with session.post(url + "/v1/embeddings", json={"model": LOCAL_MODEL, "input": text_for(i)}) as resp:
            data = await resp.json(content_type=None)
            elapsed = time.perf_counter() - started
            ok = resp.status == 200 and len((data.get("data") or [{}])[0].get("embedding") or []) == 384
            return Sample(elapsed, resp.status if ok else 599, {"X-Broker-Cache": resp.headers.get("X-Broker-Cache", "")})

    return send


async def closed_loop_for(send: RequestFn, *, concurrency: int, seconds: float) -> tuple[list[Sample], float]:
    """`concurrency` workers sending back to back until `seconds` have passed; returns samples and wall seconds."""
    samples: list[Sample] = []
    counter = itertools.count()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency * 2)) as session:
        started = time.perf_counter()
        deadline = started + seconds

        async def worker() -> None:
            while time.perf_counter() < deadline:
                samples.append(await send(session, next(counter)))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return samples, time.perf_counter() - started


async def sequential(send: RequestFn, count: int) -> tuple[list[Sample], float]:
    """`count` requests one after another (latency without queueing); returns samples and wall seconds."""
    async with aiohttp.ClientSession() as session:
        started = time.perf_counter()
        samples = [await send(session, i) for i in range(count)]
        return samples, time.perf_counter() - started


def latency_summary(samples: Sequence[Sample]) -> dict[str, Any]:
    """Count, errors and latency percentiles (ms) of some samples, with the share answered from a cache."""
    lat = [s.latency_s * 1000 for s in samples]
    n = len(samples)
    return {"texts": n, "errors": sum(1 for s in samples if s.status != 200),
            "p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99), "mean_ms": sum(lat) / n if n else 0.0,
            "cache_hit_share": sum(1 for s in samples if s.headers.get("X-Broker-Cache") == "hit") / n if n else 0.0}


def batch_figures(before: Metrics, after: Metrics, texts: int, cpu_s: float) -> dict[str, float]:
    """Model calls, mean texts per call, share of texts that reached the model, and broker CPU per text."""
    calls = delta(before, after, "mergebroker_embedding_batch_size_count")
    embedded = delta(before, after, "mergebroker_embedding_batch_size_sum")
    return {"model_calls": calls, "mean_batch_size": embedded / calls if calls else 0.0,
            "texts_to_model": embedded, "share_to_model": embedded / texts if texts else 0.0,
            "l1_hits": delta(before, after, "mergebroker_embedding_cache_events_total", level="l1", result="hit"),
            "l2_hits": delta(before, after, "mergebroker_embedding_cache_events_total", level="l2", result="hit"),
            "coalesced": delta(before, after, "mergebroker_embedding_coalesced_total"),
            "broker_cpu_ms_per_text": 1000 * cpu_s / texts if texts else 0.0}


Drive = Callable[[RequestFn], Awaitable[tuple[list[Sample], float]]]


async def measure(broker: Process, send: RequestFn, drive: Drive) -> dict[str, Any]:
    """Drive `send` with `drive`, returning latency figures plus the broker's batch and cache figures."""
    before, cpu_before = await scrape(broker.url), broker.cpu()
    samples, wall_s = await drive(send)
    cpu_s = broker.cpu() - cpu_before
    after = await scrape(broker.url)
    return {**latency_summary(samples), **batch_figures(before, after, len(samples), cpu_s),
            "wall_s": round(wall_s, 3), "texts_per_s": len(samples) / wall_s if wall_s else 0.0}


async def throughput_matrix(sim: Process, setup: EmbeddingSetup, plan: EmbeddingPlan) -> dict[str, Any]:
    """Texts/s and latency at each concurrency for one setup, then the repeated-texts stream on the same broker."""
    broker = await start_broker(embedding_config(sim.url, batching=setup.batching))
    try:
        await sequential(embedding_request(broker.url, lambda i: f"warm-up text {i} for {setup.name}"), 4)
        levels = []
        for conc in plan.concurrencies:
            texts = lambda i, conc=conc: distinct_texts(1, namespace=f"[{setup.name} c{conc}] ", start=i)[0]  # noqa: E731
            figures = await measure(broker, embedding_request(broker.url, texts),
                                    lambda send, conc=conc: closed_loop_for(send, concurrency=conc,
                                                                            seconds=plan.seconds_per_level))
            levels.append({"concurrency": conc, **figures})
        stream = with_repeats(plan.repeat_texts, repeat_share=plan.repeat_share, namespace=f"[{setup.name} rep] ")
        repeated = await measure(broker, embedding_request(broker.url, stream.__getitem__),
                                 lambda send: closed_loop(send, concurrency=plan.repeat_concurrency,
                                                          total=len(stream)))
    finally:
        broker.stop()
    return {**asdict(setup), "levels": levels, "repeated": {"repeat_share": plan.repeat_share, **repeated}}


@contextlib.asynccontextmanager
async def redis_server() -> AsyncIterator[str]:
    """A throw-away `redis-server --save ''` on a free loopback port; yields its URL."""
    port, workdir = free_port(), tempfile.mkdtemp(prefix="mb-bench-redis-")
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
                             "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        await _until(lambda client: client.ping(), url)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


async def _until(check: Callable[[Any], Any], url: str, timeout_s: float = 10.0) -> None:
    """Poll `check(client)` until it is truthy: a child process's state has no event to wait on."""
    client = aioredis.from_url(url)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            with contextlib.suppress(OSError, aioredis.ConnectionError):
                if await check(client):
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis at {url}: condition not met within {timeout_s} s")
            await asyncio.sleep(0.05)
    finally:
        await client.aclose()


async def _l2_keys(client: Any) -> int:
    return len([k async for k in client.scan_iter(match=L2_PREFIX + "*", count=1000)])


async def cache_latency(sim: Process, plan: EmbeddingPlan) -> dict[str, Any]:
    """Latency of a miss, an L1 hit and (after a broker restart, so L1 is empty) an L2 hit from Redis."""
    texts = distinct_texts(plan.cache_texts, namespace="[cache probe] ")
    warm_ups = 4  # the same few texts warm each broker up (computed by the first, read from Redis by the second)

    async def probe(broker: Process) -> dict[str, Any]:
        return await measure(broker, embedding_request(broker.url, texts.__getitem__),
                             lambda send: sequential(send, len(texts)))

    async with redis_server() as url:
        broker = await start_broker(embedding_config(sim.url, batching=True, redis_url=url))
        try:
            await sequential(embedding_request(broker.url, lambda i: f"warm-up text {i}"), warm_ups)
            miss, l1 = await probe(broker), await probe(broker)
        finally:
            broker.stop()
        await _until(lambda client: _has_keys(client, len(texts) + warm_ups), url)
        broker = await start_broker(embedding_config(sim.url, batching=True, redis_url=url))
        try:
            await sequential(embedding_request(broker.url, lambda i: f"warm-up text {i}"), warm_ups)
            l2 = await probe(broker)
        finally:
            broker.stop()
    return {"texts": len(texts), "miss": miss, "l1_hit": l1, "l2_hit": l2}


async def _has_keys(client: Any, count: int) -> bool:
    return await _l2_keys(client) >= count


async def model_cost(plan: EmbeddingPlan) -> list[dict[str, Any]]:
    """CPU per model call and per text by batch size, float model and int8 copy, measured in this process.

    The model runs on `SentenceModelHost`'s worker thread with one torch thread, as in the broker; its CPU
    is the run time of this process's threads other than the main one, whose event loop only waits.
    """
    from mergebroker.providers.local.model import SentenceModelHost

    host = SentenceModelHost(threads=1, int8_copy=True)
    texts = iter(distinct_texts(10_000, namespace="[model cost] "))
    rows = []
    try:
        await host.load()
        for int8 in (False, True):
            await host.encode([next(texts) for _ in range(8)], int8=int8)  # first-call costs stay out
            for size in plan.cost_batch_sizes:
                calls = max(3, plan.cost_texts // size)
                cpu, started = off_loop_seconds(os.getpid()), time.perf_counter()
                for _ in range(calls):
                    await host.encode([next(texts) for _ in range(size)], int8=int8)
                cpu_ms = 1000 * (off_loop_seconds(os.getpid()) - cpu) / calls
                rows.append({"embedder": "local-int8" if int8 else "local", "batch": size, "calls": calls,
                             "cpu_ms_per_call": cpu_ms, "cpu_ms_per_text": cpu_ms / size,
                             "wall_ms_per_call": 1000 * (time.perf_counter() - started) / calls})
    finally:
        host.close()
    return rows


async def run_embeddings(plan: EmbeddingPlan = FULL_EMBEDDING_PLAN, *, on_step: OnStep | None = None
                         ) -> dict[str, Any]:
    """Every measurement of `plan`, as the JSON-ready dict written to `embeddings.json`."""
    done = on_step or (lambda name: None)
    started, probe = time.perf_counter(), cpu_probe_ms()
    setups = [EmbeddingSetup("one text per call", False), EmbeddingSetup("window batching", True)]
    sim = await start_simulator()
    try:
        matrix = []
        for setup in setups:
            matrix.append(await throughput_matrix(sim, setup, plan))
            done(setup.name)
        cache = await cache_latency(sim, plan)
        done("cache latency")
    finally:
        sim.stop()
    cost = await model_cost(plan)
    done("model cost")
    backends = run_backends(plan.backends)
    done("similarity backends")
    return {"matrix": matrix, "cache": cache, "model_cost": cost, "backends": backends,
            "meta": {"plan": asdict(plan), "model": LOCAL_MODEL, **run_meta(started, probe)}}


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m bench.embeddings [--quick] [--out FILE]`: run the embeddings benchmark and write its JSON."""
    from tqdm import tqdm

    parser = argparse.ArgumentParser(prog="bench.embeddings", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke-sized runs")
    parser.add_argument("--out", default=str(RESULTS_PATH), help="result file (default: %(default)s)")
    args = parser.parse_args(argv)
    plan = QUICK_EMBEDDING_PLAN if args.quick else FULL_EMBEDDING_PLAN
    with tqdm(total=plan.step_count(), desc="embeddings", unit="step") as bar:
        results = asyncio.run(run_embeddings(plan, on_step=lambda name: (bar.set_postfix_str(name), bar.update())))
    write_json(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
