"""Merge-engine benchmark: passthrough vs. merging against a simulator with realistic latency.

Each run starts a fresh broker process (so caches, the vector cache and CPU counters start clean),
warms it up, then drives one workload and reads three sources: the replies (latency, answers checked
against `answer_for`), the broker's `/metrics` (merge counters, before/after deltas) and the
simulator's `/stats` (upstream calls and tokens, reset before each run). Scenarios: the main mixed
workload on the batch and standard tiers, hot-question bursts on the standard tier, and sweeps of the
similarity threshold, the merge window and the arrival rate. The standard tier also runs with the float
similarity model (`merge.embedder: local`) beside the default int8 copy on onnxruntime (`local-onnx`), so the default is
judged by numbers, and with a longer similarity budget (`similarity_budget_ms`) than the default. `python -m bench.merging [--quick]` writes `bench/results/merging.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.harness import (
    Process,
    RequestFn,
    Sample,
    chat_request,
    cpu_probe_ms,
    off_loop_seconds,
    open_loop,
    percentile,
    post_json,
    run_meta,
    start_broker,
    start_simulator,
    write_json,
)
from bench.workloads import ChatItem, hot_question_topics, hot_question_versions, mixed_workload
from mergebroker.broker.engine.ground.settings import default_tiers
from mergebroker.providers.simulator.server import answer_for

RESULTS_PATH = Path(__file__).parent / "results" / "merging.json"
SIM_OPTIONS = ("--latency-base-ms", "300", "--latency-per-token-ms", "2")
MODEL = "sim-small"
CDF_POINTS = 200

Metrics = dict[tuple[str, frozenset], float]
Driver = Callable[[RequestFn], Awaitable[tuple[list[Sample], float]]]
OnRun = Callable[[str], None]


@dataclass(frozen=True)
class Plan:
    """Sizes of every scenario; `QUICK_PLAN` is a smoke-sized copy."""

    rate: float = 100.0
    requests: int = 900
    sweep_requests: int = 600
    bursts: int = 6
    burst_versions: int = 30
    burst_spread_s: float = 0.1
    burst_gap_s: float = 0.3
    thresholds: tuple[float, ...] = (0.0, 0.5, 0.85, 0.95)
    windows_ms: tuple[float, ...] = (0, 10, 25, 50, 100, 200)
    rates: tuple[float, ...] = (25, 50, 100, 200)
    rate_sweep_s: float = 4.0

    def run_count(self) -> int:
        """How many broker runs the plan makes (for progress bars)."""
        return 6 + 4 + len(self.thresholds) + len(self.windows_ms) + len(self.rates)


FULL_PLAN = Plan()
QUICK_PLAN = Plan(requests=120, sweep_requests=60, bursts=1, thresholds=(0.0, 0.85), windows_ms=(0, 50),
                  rates=(50, 100), rate_sweep_s=0.8)


@dataclass(frozen=True)
class RunSpec:
    """One broker configuration: the tier the load uses, merging on or off, tier overrides, similarity model."""

    name: str
    tier: str
    merge: bool = True
    window_ms: float | None = None
    threshold: float | None = None
    embedder: str = "local-onnx"  # `merge.embedder`; the broker's default
    similarity_budget_ms: float | None = None  # the tier's `similarity_budget_ms`; None keeps the default


# The standard tier with the float similarity model, and with a longer similarity budget, beside the defaults.
FLOAT_RUN = "merge/standard, float model"
LONG_BUDGET_MS = 200.0
BUDGET_RUN = f"merge/standard, similarity budget {LONG_BUDGET_MS:g} ms"
P99_ALLOWANCE_MS = 50.0  # merging may add its tier's window plus this much at p99 (the target)
EMBEDDING_CPU_GOAL_MS = 2.0  # similarity-embedding CPU per request (the target)


def broker_config(sim_url: str, spec: RunSpec) -> dict[str, Any]:
    """The broker settings dict of a run: the default tiers with the run's overrides, one simulated upstream.

    When the tier under test does not consult similarity (threshold 0, or merging off) the embedding
    model is switched off: it would never run, and loading it costs seconds of start-up per run.
    """
    tiers = []
    embeds = False
    for tier in default_tiers():
        data = tier.model_dump()
        if tier.name == spec.tier:
            if spec.window_ms is not None:
                data["window_ms"] = spec.window_ms
            if spec.threshold is not None:
                data["similarity_threshold"] = spec.threshold
            if spec.similarity_budget_ms is not None:
                data["similarity_budget_ms"] = spec.similarity_budget_ms
            embeds = spec.merge and data["similarity_threshold"] > 0
        tiers.append(data)
    return {"providers": [{"name": "sim", "base_url": sim_url + "/v1", "max_connections": 256}],
            "tiers": tiers, "merge": {"enabled": spec.merge, "embedder": spec.embedder if embeds else "none"}}


def chat_body(item: ChatItem) -> dict[str, Any]:
    """The OpenAI chat body of a workload item (temperature 0, so exact repeats may be served from cache)."""
    return {"model": MODEL, "temperature": 0,
            "messages": [{"role": "system", "content": item.system}, {"role": "user", "content": item.question}]}


def body_source(items: Sequence[ChatItem], tier: str) -> Callable[[int], tuple[dict, dict, str]]:
    """`harness.chat_request`'s body function; the sample tag is the answer the reply must carry."""
    headers = {"X-Broker-Tier": tier}
    return lambda i: (chat_body(items[i]), headers, answer_for(items[i].question))


def poisson(rate: float, total: int) -> Driver:
    """Open-loop Poisson arrivals at `rate` req/s."""
    return lambda send: open_loop(send, rate=rate, total=total)


def bursts(count: int, per_burst: int, spread_s: float, gap_s: float) -> Driver:
    """`count` bursts of `per_burst` requests spread evenly over `spread_s`; each burst completes, then a gap."""

    async def drive(send: RequestFn) -> tuple[list[Sample], float]:
        samples: list[Sample] = []
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            started = time.perf_counter()
            for b in range(count):
                t0, tasks = time.perf_counter(), []
                for k in range(per_burst):
                    delay = t0 + k * spread_s / per_burst - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)  # the arrival schedule itself
                    tasks.append(asyncio.create_task(send(session, b * per_burst + k)))
                samples.extend(await asyncio.gather(*tasks))
                await asyncio.sleep(gap_s)  # idle time between bursts, part of the scenario
            return samples, time.perf_counter() - started

    return drive


async def scrape(url: str) -> Metrics:
    """Every sample of a broker's `/metrics`, keyed by (sample name, label set)."""
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/metrics") as resp:
            text = await resp.text()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(metrics: Metrics, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in metrics.items() if n == name and wanted <= ls)


def delta(before: Metrics, after: Metrics, name: str, **labels: str) -> float:
    """How much a counter (or histogram sum/count) grew between two scrapes."""
    return total(after, name, **labels) - total(before, name, **labels)


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def _content(sample: Sample) -> str | None:
    try:
        return sample.body["choices"][0]["message"]["content"]  # type: ignore[index]
    except (TypeError, KeyError, IndexError):
        return None


def _batch_size(sample: Sample) -> int:
    """How many requests shared the upstream call that answered `sample` (its `X-Broker-Batch-Size`)."""
    value = next((v for k, v in sample.headers.items() if k.lower() == "x-broker-batch-size"), "1")
    return int(value) if value.isdigit() else 1


def _rejections(before: Metrics, after: Metrics) -> dict[str, float]:
    """Requests the broker refused during the run, by reason (rate_limited, queue_full, deadline, ...)."""
    reasons = {dict(labels).get("reason", "") for name, labels in after if name == "mergebroker_rejected_total"}
    counts = {r: delta(before, after, "mergebroker_rejected_total", reason=r) for r in reasons}
    return {r: n for r, n in counts.items() if n > 0}


def cdf_points(latencies_ms: Sequence[float], points: int = CDF_POINTS) -> list[float]:
    """Latency at `points + 1` evenly spaced quantiles (0..100 %), enough to draw a CDF."""
    return [round(percentile(latencies_ms, 100 * k / points), 2) for k in range(points + 1)]


def summarize_run(spec: RunSpec, samples: list[Sample], wall_s: float, before: Metrics, after: Metrics,
                  sim_stats: dict[str, Any], cpu_s: float, model_cpu_s: float = 0.0) -> dict[str, Any]:
    """The figures of one run: per-request upstream cost, merge counters, latency, CPU, correctness.

    `cpu_s` is the broker's CPU over the run, `model_cpu_s` the part its threads other than the event loop
    ran (the similarity model's worker thread): the embedding CPU.
    """
    n = len(samples)
    lat = [s.latency_s * 1000 for s in samples]
    caches = [s.headers.get("X-Broker-Cache", "") for s in samples]
    merged_lat = [ms for ms, s in zip(lat, samples) if s.status == 200 and _batch_size(s) > 1]
    alone_lat = [ms for ms, s in zip(lat, samples) if s.status == 200 and _batch_size(s) == 1]

    def d(name: str, **labels: str) -> float:
        return delta(before, after, name, **labels)

    return {
        **asdict(spec), "requests": n, "wall_s": round(wall_s, 3), "rps": _ratio(n, wall_s),
        "errors": sum(1 for s in samples if s.status != 200),
        "error_statuses": {str(k): v for k, v in sorted(Counter(s.status for s in samples if s.status != 200).items())},
        "rejected": _rejections(before, after),
        "wrong_answers": sum(1 for s in samples if s.status == 200 and _content(s) != s.tag),
        "upstream_calls": sim_stats["chat_calls"], "merged_calls": sim_stats["merged_calls"],
        "upstream_calls_per_request": _ratio(sim_stats["chat_calls"], n),
        "prompt_tokens_per_request": _ratio(sim_stats["prompt_tokens"], n),
        "completion_tokens_per_request": _ratio(sim_stats["completion_tokens"], n),
        "merge_rate": _ratio(d("mergebroker_merged_requests_total", tier=spec.tier), n),
        "mean_batch_size": _ratio(d("mergebroker_batch_size_sum", tier=spec.tier),
                                  d("mergebroker_batch_size_count", tier=spec.tier)),
        "split_fallback_rate": _ratio(d("mergebroker_split_fallback_total"), n),
        "similarity_slow_rate": _ratio(d("mergebroker_merge_skipped_total", reason="similarity_slow"), n),
        "cache_hit_rate": _ratio(caches.count("hit"), n), "coalesced_rate": _ratio(caches.count("coalesced"), n),
        "p50_ms": percentile(lat, 50), "p90_ms": percentile(lat, 90), "p99_ms": percentile(lat, 99),
        "mean_ms": _ratio(sum(lat), n),
        "p99_ms_merged": percentile(merged_lat, 99), "p99_ms_alone": percentile(alone_lat, 99),
        "queue_wait_ms_mean": 1000 * _ratio(d("mergebroker_queue_wait_seconds_sum", tier=spec.tier),
                                            d("mergebroker_queue_wait_seconds_count", tier=spec.tier)),
        "upstream_ms_mean": 1000 * _ratio(d("mergebroker_upstream_latency_seconds_sum"),
                                          d("mergebroker_upstream_latency_seconds_count")),
        "broker_cpu_ms_per_request": 1000 * _ratio(cpu_s, n),
        "embedding_cpu_ms_per_request": 1000 * _ratio(model_cpu_s, n),
        "embedding_ms_per_request": 1000 * _ratio(d("mergebroker_embedding_seconds_sum"), n),
        "embedding_calls": d("mergebroker_embedding_seconds_count"),
        "latency_cdf_ms": cdf_points(lat),
    }


async def warm_up(broker_url: str, tier: str, count: int = 12) -> None:
    """Similar requests at once, so connections open and (where the tier embeds) the model has run once."""
    items = [ChatItem("support", f"Warm-up question number {i}: is the service answering?", "warmup")
             for i in range(count)]
    send = chat_request(broker_url, body_source(items, tier))
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(send(session, i) for i in range(count)))


async def measure(sim: Process, spec: RunSpec, items: Sequence[ChatItem], drive: Driver,
                  config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run `items` through a fresh broker configured by `spec` (or by `config`, when given) with `drive`;
    return `summarize_run`'s figures."""
    broker = await start_broker(config if config is not None else broker_config(sim.url, spec))
    try:
        await warm_up(broker.url, spec.tier)
        before, cpu_before, model_before = await scrape(broker.url), broker.cpu(), off_loop_seconds(broker.proc.pid)
        await post_json(sim.url + "/stats/reset", {})
        samples, wall_s = await drive(chat_request(broker.url, body_source(items, spec.tier), keep_body=True))
        cpu_s, model_cpu_s = broker.cpu() - cpu_before, off_loop_seconds(broker.proc.pid) - model_before
        after = await scrape(broker.url)
        async with aiohttp.ClientSession() as session:
            async with session.get(sim.url + "/stats") as resp:
                sim_stats = await resp.json()
    finally:
        broker.stop()
    return summarize_run(spec, samples, wall_s, before, after, sim_stats, cpu_s, model_cpu_s)


async def run_merging(plan: Plan = FULL_PLAN, *, on_run: OnRun | None = None) -> dict[str, Any]:
    """Every scenario of `plan`, as the JSON-ready dict written to `merging.json`."""
    done = on_run or (lambda name: None)
    started, probe = time.perf_counter(), cpu_probe_ms()
    sim = await start_simulator(*SIM_OPTIONS)
    try:
        async def run(spec: RunSpec, items: Sequence[ChatItem], drive: Driver) -> dict[str, Any]:
            result = await measure(sim, spec, items, drive)
            done(spec.name)
            return result

        results = {"main": await _main_scenario(plan, run), "burst": await _burst_scenario(plan, run),
                   **await _sweeps(plan, run)}
    finally:
        sim.stop()
    results["meta"] = {"plan": asdict(plan), "simulator_options": list(SIM_OPTIONS), "model": MODEL,
                       **run_meta(started, probe)}
    results["targets"] = check_targets(results)
    return results


Run = Callable[[RunSpec, Sequence[ChatItem], Driver], Awaitable[dict[str, Any]]]


async def _main_scenario(plan: Plan, run: Run) -> dict[str, Any]:
    items = mixed_workload(plan.requests, seed=1)
    runs = {}
    for tier in ("batch", "standard"):
        for merge in (False, True):
            spec = RunSpec(f"{'merge' if merge else 'passthrough'}/{tier}", tier, merge=merge)
            runs[spec.name] = await run(spec, items, poisson(plan.rate, len(items)))
    for spec in (RunSpec(FLOAT_RUN, "standard", embedder="local"),
                 RunSpec(BUDGET_RUN, "standard", similarity_budget_ms=LONG_BUDGET_MS)):
        runs[spec.name] = await run(spec, items, poisson(plan.rate, len(items)))
    return {"rate": plan.rate, "requests": len(items), "runs": runs}


async def _burst_scenario(plan: Plan, run: Run) -> dict[str, Any]:
    count = min(plan.bursts, hot_question_topics())  # one hot question per burst: no cache hits across bursts
    items = [item for b in range(count) for item in hot_question_versions(b, plan.burst_versions)]
    drive = bursts(count, plan.burst_versions, plan.burst_spread_s, plan.burst_gap_s)
    runs = {}
    for spec in (RunSpec("passthrough/standard", "standard", merge=False), RunSpec("merge/standard", "standard"),
                 RunSpec(FLOAT_RUN, "standard", embedder="local"),
                 RunSpec(BUDGET_RUN, "standard", similarity_budget_ms=LONG_BUDGET_MS)):
        runs[spec.name] = await run(spec, items, drive)
    return {"bursts": count, "versions": plan.burst_versions, "spread_ms": plan.burst_spread_s * 1000,
            "runs": runs}


async def _sweeps(plan: Plan, run: Run) -> dict[str, Any]:
    items = mixed_workload(plan.sweep_requests, seed=2)
    base = RunSpec("", "batch")
    thresholds = [await run(replace(base, name=f"threshold {t:g}", threshold=t), items,
                            poisson(plan.rate, len(items))) for t in plan.thresholds]
    windows = [await run(replace(base, name=f"window {w:g} ms", window_ms=w), items,
                         poisson(plan.rate, len(items))) for w in plan.windows_ms]
    rates = []
    for rate in plan.rates:
        rate_items = mixed_workload(max(20, round(rate * plan.rate_sweep_s)), seed=3)
        rates.append({"rate": rate, **await run(replace(base, name=f"rate {rate:g}/s"), rate_items,
                                                 poisson(rate, len(rate_items)))})
    return {"threshold_sweep": {"tier": "batch", "rate": plan.rate, "points": thresholds},
            "window_sweep": {"tier": "batch", "rate": plan.rate, "points": windows},
            "rate_sweep": {"tier": "batch", "points": rates}}


def check_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each with the measured value and whether it was met."""
    main, burst = results["main"]["runs"], results["burst"]["runs"]
    windows = {t.name: t.window_ms for t in default_tiers()}

    def fewer(base: dict, run: dict, key: str) -> float:
        return _ratio(base[key], run[key])

    every = [r for scenario in (main, burst) for r in scenario.values()]
    every += [p for sweep in ("threshold_sweep", "window_sweep", "rate_sweep") for p in results[sweep]["points"]]
    merged = [main["merge/batch"], main["merge/standard"], burst["merge/standard"]]
    rows = [
        ("batch tier: upstream calls, x fewer than passthrough", fewer(main["passthrough/batch"], main["merge/batch"],
                                                                      "upstream_calls_per_request"), ">=", 4.0),
        ("batch tier: prompt tokens, x fewer than passthrough", fewer(main["passthrough/batch"], main["merge/batch"],
                                                                     "prompt_tokens_per_request"), ">=", 2.5),
        ("standard tier bursts: upstream calls, x fewer", fewer(burst["passthrough/standard"], burst["merge/standard"],
                                                                "upstream_calls_per_request"), ">=", 3.0),
        ("wrong answers, all runs", float(sum(r["wrong_answers"] for r in every)), "==", 0.0),
        ("errors (non-200), all runs", float(sum(r["errors"] for r in every)), "==", 0.0),
        ("batch tier: p99 above passthrough (ms)", main["merge/batch"]["p99_ms"] - main["passthrough/batch"]["p99_ms"],
         "<=", windows["batch"] + P99_ALLOWANCE_MS),
        ("standard tier: p99 above passthrough (ms)",
         main["merge/standard"]["p99_ms"] - main["passthrough/standard"]["p99_ms"], "<=",
         windows["standard"] + P99_ALLOWANCE_MS),
        ("embedding CPU per request (ms), worst merged run (int8 model)",
         max(r["embedding_cpu_ms_per_request"] for r in merged), "<", EMBEDDING_CPU_GOAL_MS),
    ]
    compare = {">=": float.__ge__, "<=": float.__le__, "<": float.__lt__, "==": float.__eq__}
    return [{"name": name, "value": round(float(value), 3), "op": op, "target": target,
             "met": bool(compare[op](float(value), float(target)))} for name, value, op, target in rows]


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m bench.merging [--quick] [--out FILE]`: run the merge benchmark and write its JSON."""
    from tqdm import tqdm

    parser = argparse.ArgumentParser(prog="bench.merging", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke-sized runs")
    parser.add_argument("--out", default=str(RESULTS_PATH), help="result file (default: %(default)s)")
    args = parser.parse_args(argv)
    plan = QUICK_PLAN if args.quick else FULL_PLAN
    with tqdm(total=plan.run_count(), desc="merging", unit="run") as bar:
        results = asyncio.run(run_merging(plan, on_run=lambda name: (bar.set_postfix_str(name), bar.update())))
    write_json(args.out, results)
    for target in results["targets"]:
        print(f"{'met ' if target['met'] else 'MISS'} {target['name']}: {target['value']} "
              f"(target {target['op']} {target['target']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
