"""Cluster savings on an independent workload: does cluster mode keep one replica's call savings?

The workload is not the merge benchmark's: two clients, each an open-loop Poisson stream at half the
rate and each sending its requests round-robin over the front-ends; 15 % of the requests repeat an
earlier question exactly; the rest are distinct questions under two system prompts, on the batch tier.
Each configuration gets the same arrivals: passthrough (no merging, no cache: the cost of every request
sent alone), one replica merging in process, and 2 front-ends + 2 workers on Redis Streams at the
default cluster settings (or `--cluster-json`). Savings are 1 - calls per request / passthrough's; the
cluster keeps its savings over the single replica's. Members per merged call (from the dispatchers'
counters and the simulator's merged calls) tell whether the batches fill the same way.

`--tree DIR` runs the brokers from another checkout (e.g. `git worktree add /tmp/old-cluster HEAD`): the
child processes import `mergebroker` from a shadow package built over DIR, so the old code runs beside
the new under the same load generator. `--rounds N` repeats each configuration, alternating the trees.

    python -m bench.cluster_savings [--quick] [--tree /tmp/old-cluster] [--rounds 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis

from bench.cluster import TIER, _in_cluster_mode, _start, checked_request, start_redis
from bench.harness import cpu_probe_ms, post_json, processes_together, results_path, run_meta, start_simulator
from bench.merging import SIM_OPTIONS, RunSpec, broker_config, scrape, total
from bench.workloads import ChatItem

APPS = ("support", "cooking")  # two system prompts
REPEAT_SHARE = 0.15
CLIENTS = 2


@dataclass(frozen=True)
class Plan:
    """The offered rate (both clients together), how long each run lasts, and how many rounds."""

    rate: float = 100.0
    duration_s: float = 8.0
    rounds: int = 1
    cold: bool = False  # load as soon as every process answers /readyz, as a client outside would
    window_ms: float | None = None  # the batch tier's merge window (None: the shipped default)


FULL = Plan()
QUICK = Plan(duration_s=2.0)

LAYOUTS = (("passthrough", 1, 0, False), ("single", 1, 0, True), ("cluster", 2, 2, True))
"""(name, front-ends, workers, merging)."""


def independent_workload(n: int, *, seed: int = 26, repeat: float = REPEAT_SHARE) -> list[ChatItem]:
    """`n` requests: distinct questions under two system prompts, `repeat` of them exact repeats of an
    earlier question (any earlier one, so some are answered from the cache and some coalesce in flight)."""
    rng = random.Random(seed)
    items: list[ChatItem] = []
    for i in range(n):
        if items and rng.random() < repeat:
            source = rng.choice(items)
            items.append(ChatItem(source.app, source.question, "repeat"))
        else:
            topic = rng.choice(["a shared folder", "a recipe", "an invoice", "a backup", "a sauce", "a device"])
            items.append(ChatItem(rng.choice(APPS), f"Client question {i}: what should I check first about "
                                                    f"{topic} number {rng.randrange(10_000)}?", "distinct"))
    return items


async def two_clients(frontends: Sequence[str], items: Sequence[ChatItem], rate: float) -> tuple[list[Any], float]:
    """Each client sends every other item at `rate / 2` (Poisson), round-robin over the front-ends."""
    sends = [checked_request(url, items) for url in frontends]
    started = time.perf_counter()

    async def client(c: int) -> list[Any]:
        rng, mine, tasks = random.Random(100 + c), list(range(c, len(items), CLIENTS)), []
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            next_at = time.perf_counter()
            for k, i in enumerate(mine):
                next_at += rng.expovariate(rate / CLIENTS)
                delay = next_at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)  # the arrival process itself
                tasks.append(asyncio.create_task(sends[(k + c) % len(sends)](session, i)))
            return list(await asyncio.gather(*tasks))

    per_client = await asyncio.gather(*(client(c) for c in range(CLIENTS)))
    return [s for samples in per_client for s in samples], time.perf_counter() - started


@contextlib.contextmanager
def code_tree(tree: str | None) -> Iterator[None]:
    """Child processes spawned inside import `mergebroker` from `tree` (None: this checkout)."""
    if tree is None:
        yield
        return
    shadow = shadow_package(Path(tree))
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(shadow) + (os.pathsep + saved if saved else "")
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def shadow_package(tree: Path) -> Path:
    """A directory whose `mergebroker` package is `tree`'s core/ with its other top-level folders inside,
    as the editable install maps them; found on PYTHONPATH before the installed finder."""
    root = Path(tempfile.mkdtemp(prefix="mb-tree-"))
    package = root / "mergebroker"
    package.mkdir()
    for entry in (tree / "core").iterdir():
        (package / entry.name).symlink_to(entry)
    for folder in ("broker", "merge", "breaker", "providers"):
        (package / folder).symlink_to(tree / folder)
    return root


@contextlib.asynccontextmanager
async def deployed(frontends: int, workers: int, merge: bool, sim_url: str, redis_url: str,
                   cluster: dict[str, Any], window_ms: float | None = None) -> AsyncIterator[tuple[list[Any], list[Any]]]:
    """The processes of one layout (each tree gets the same settings, written out in full)."""
    spec = RunSpec("savings", TIER, merge=merge, window_ms=window_ms)
    config = {**broker_config(sim_url, spec), "redis": {"url": redis_url}}
    if not merge:
        config["cache"] = {"enabled": False}
    if workers:
        config["cluster"] = {"enabled": True, **cluster}
    starters = [_start("worker", config) for _ in range(workers)] + [_start("serve", config) for _ in range(frontends)]
    async with processes_together(*starters) as started:
        yield started[:workers], started[workers:]


DISPATCH_COUNTERS = ("mergebroker_merged_requests_total", "mergebroker_batches_total", "mergebroker_batch_size_sum")


async def measure(layout: tuple[str, int, int, bool], plan: Plan, sim: Any, redis_url: str, items: list[ChatItem],
                  tree: str | None, cluster: dict[str, Any]) -> dict[str, Any]:
    """One run of one layout on one code tree."""
    name, n_front, n_workers, merge = layout
    client = aioredis.Redis.from_url(redis_url)
    await client.flushall()
    await client.aclose()
    with code_tree(tree):
        deployment = deployed(n_front, n_workers, merge, sim.url, redis_url, cluster, plan.window_ms)
        workers, frontends = await deployment.__aenter__()
    try:
        if not plan.cold:
            if workers:
                await _in_cluster_mode(frontends)
            warm = [ChatItem("support", f"Warm-up question {i}: is the service answering?", "warmup")
                    for i in range(8)]
            async with aiohttp.ClientSession() as session:
                await asyncio.gather(*(checked_request(f.url, warm)(session, i) for f in frontends for i in range(8)))
        dispatchers = workers or frontends
        before = [await scrape(p.url) for p in dispatchers + frontends]
        await post_json(sim.url + "/stats/reset", {})
        samples, wall_s = await two_clients([f.url for f in frontends], items, plan.rate)
        after = [await scrape(p.url) for p in dispatchers + frontends]
        async with aiohttp.ClientSession() as session:
            async with session.get(sim.url + "/stats") as resp:
                sim_stats = await resp.json()
    finally:
        await deployment.__aexit__(None, None, None)
    grown = {key: sum(total(a, key) - total(b, key) for a, b in zip(after[:len(dispatchers)], before))
             for key in DISPATCH_COUNTERS}
    decisions = {d: sum(total(a, "mergebroker_window_decisions_total", decision=d)
                        - total(b, "mergebroker_window_decisions_total", decision=d)
                        for a, b in zip(after[:len(dispatchers)], before)) for d in ("wait", "skip", "join")}
    n = len(samples)
    calls, merged = sim_stats["chat_calls"], sim_stats["merged_calls"]
    return {"layout": name, "tree": tree or "new", "requests": n, "wall_s": round(wall_s, 2),
            "errors": sum(1 for s in samples if s.status != 200),
            "wrong_answers": sum(1 for s in samples if s.status == 200 and (s.body or {}).get("content") != s.tag),
            "upstream_calls": calls, "merged_calls": merged, "calls_per_request": calls / n if n else 0.0,
            "prompt_tokens_per_request": sim_stats["prompt_tokens"] / n if n else 0.0,
            "items_dispatched": grown["mergebroker_batch_size_sum"],
            "members_per_merged_call": grown["mergebroker_merged_requests_total"] / merged if merged else None,
            "window_decisions": decisions,
            "p50_ms": statistics.median([s.latency_s * 1000 for s in samples]) if samples else None}


def kept(runs: list[dict[str, Any]], tree: str) -> dict[str, float | None]:
    """The cluster's share of the single replica's call savings on `tree`, from the mean of its rounds."""
    def mean(layout: str, key: str) -> float | None:
        values = [r[key] for r in runs if r["layout"] == layout and r["tree"] == tree and r[key] is not None]
        return statistics.fmean(values) if values else None

    base, single, cluster = (mean(name, "calls_per_request") for name in ("passthrough", "single", "cluster"))
    if not base or single is None or cluster is None:
        return {"kept": None}
    saved_single, saved_cluster = 1 - single / base, 1 - cluster / base
    return {"single_saved": saved_single, "cluster_saved": saved_cluster,
            "kept": saved_cluster / saved_single if saved_single else None,
            "single_members_per_merged_call": mean("single", "members_per_merged_call"),
            "cluster_members_per_merged_call": mean("cluster", "members_per_merged_call")}


async def run(plan: Plan, trees: list[str | None], cluster: dict[str, Any]) -> dict[str, Any]:
    """Every layout on every tree, `plan.rounds` times, the trees alternating within each round."""
    started, probe = time.perf_counter(), cpu_probe_ms()
    items = independent_workload(round(plan.rate * plan.duration_s))
    runs: list[dict[str, Any]] = []
    async with processes_together(start_simulator(*SIM_OPTIONS)) as (sim,):
        redis = await start_redis()
        try:
            for round_no in range(plan.rounds):
                order = trees if round_no % 2 == 0 else list(reversed(trees))
                for layout in LAYOUTS:
                    for tree in order:
                        runs.append(await measure(layout, plan, sim, f"redis://127.0.0.1:{redis.port}/0", items,
                                                  tree, cluster))
                        print(json.dumps({k: runs[-1][k] for k in ("layout", "tree", "calls_per_request",
                                                                     "members_per_merged_call", "errors",
                                                                     "wrong_answers")}), flush=True)
        finally:
            redis.stop()
    return {"plan": asdict(plan), "cluster": cluster, "runs": runs,
            "kept": {tree or "new": kept(runs, tree or "new") for tree in trees}, "meta": run_meta(started, probe)}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print the savings kept by each tree."""
    parser = argparse.ArgumentParser(prog="bench.cluster_savings", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke-sized runs")
    parser.add_argument("--tree", action="append", default=[], help="another checkout to run beside this one")
    parser.add_argument("--only-trees", action="store_true", help="run only the --tree checkouts, not this one")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--rate", type=float)
    parser.add_argument("--cold", action="store_true", help="load at once after /readyz (no settling, no warm-up)")
    parser.add_argument("--window-ms", type=float, help="the batch tier's merge window (default: the shipped one)")
    parser.add_argument("--cluster-json", default="{}", help="cluster settings (default: the shipped defaults)")
    parser.add_argument("--out", default=str(results_path("cluster_savings.json")))
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    plan = Plan(args.rate or plan.rate, plan.duration_s, args.rounds, args.cold, args.window_ms)
    trees: list[str | None] = list(args.tree) + ([] if args.only_trees else [None])
    result = asyncio.run(run(plan, trees, json.loads(args.cluster_json)))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    for tree, figures in result["kept"].items():
        print(f"{tree}: {json.dumps(figures)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
