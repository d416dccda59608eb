"""No waiting for nothing (issue 12): adaptive windows and early release, each beside the old behaviour.

Three parts, every comparison measured side by side in one run:

1. Sequential client: one client sending mergeable requests one after another (concurrency 1, distinct
   prompts, upstream latency 0) to three brokers at once: merging off (passthrough), the default config
   (adaptive windows) and the default config with `window_policy: fixed` (the old behaviour). Rounds
   rotate the order; figures are medians over rounds. Target: adaptive adds <= 2 ms at p50 over passthrough.
2. Call savings: the batch-tier mixed workload at 100 req/s and standard-tier hot-question bursts (the
   workloads of `bench.merging`), each run with adaptive and with fixed windows. Savings = 1 - upstream
   calls / requests. Target: adaptive keeps >= 95% of fixed's savings in both.
3. Early release: merged calls against an upstream that streams at a steady token rate; each member's
   latency over its direct (passthrough) latency, with early release on and off (`providers[].early_release`).
   Target: the mean added latency of merged members falls by >= 30%.

    python -m bench.latency [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

from bench.harness import (
    Process,
    chat_request,
    closed_loop,
    cpu_probe_ms,
    format_table,
    passthrough_config,
    percentile,
    processes_together,
    publish,
    results_path,
    run_meta,
    sim_base_url,
    start_broker,
    start_simulator,
    summarize,
)
from bench.merging import RunSpec, bursts, measure, poisson
from bench.merging import broker_config as merging_config
from bench.workloads import hot_question_topics, hot_question_versions, mixed_workload

ADDED_P50_TARGET_MS = 2.0
SAVINGS_SHARE_TARGET = 0.95
EARLY_RELEASE_CUT_TARGET = 0.30
SEQUENTIAL = ("passthrough", "adaptive", "fixed")
PARTS = ("sequential", "savings", "early_release", "merged_streams")


@dataclass(frozen=True)
class Plan:
    """Sizes: sequential requests per broker and round; savings workload sizes; early-release batches."""

    sequential_requests: int = 300
    rounds: int = 3
    warmup: int = 20
    mix_requests: int = 900
    mix_rate: float = 100.0
    bursts: int = 6
    burst_versions: int = 30
    early_batches: int = 40

    @property
    def smoke(self) -> bool:
        """Whether this is a smoke-sized plan."""
        return self.sequential_requests < 100


FULL = Plan()
QUICK = Plan(sequential_requests=12, rounds=1, warmup=2, mix_requests=60, bursts=1, burst_versions=8, early_batches=3)


def with_window_policy(config: dict[str, Any], policy: str) -> dict[str, Any]:
    """`config` with every tier's `window_policy` set (tiers default to `default_tiers()` when absent)."""
    from mergebroker.broker.engine.ground.settings import default_tiers

    tiers = config.get("tiers") or [t.model_dump() for t in default_tiers()]
    return {**config, "tiers": [{**t, "window_policy": policy} for t in tiers]}


def sequential_body(run_id: str) -> Callable[[int], tuple[dict[str, Any], dict[str, str], str]]:
    """Distinct single-turn prompts: mergeable (each could open a window), never cached or coalesced."""
    def make(i: int) -> tuple[dict[str, Any], dict[str, str], str]:
        text = f"sequential {run_id} request {i}: what is {i} squared?"
        return {"model": "sim-small", "messages": [{"role": "user", "content": text}]}, {}, ""

    return make


async def sequential(plan: Plan) -> dict[str, Any]:
    """Part 1: one sequential client against passthrough, adaptive and fixed brokers, rounds rotated."""
    async with processes_together(start_simulator("--latency-base-ms", "0")) as (sim,):
        upstream = sim_base_url(sim)
        default = {"providers": [{"name": "sim", "base_url": upstream}], "merge": {"embedder": "none"},
                   "cache": {"enabled": False}}
        configs = {"passthrough": passthrough_config(upstream), "adaptive": with_window_policy(default, "adaptive"),
                   "fixed": with_window_policy(default, "fixed")}
        async with processes_together(*(start_broker(c) for c in configs.values())) as started:
            brokers: dict[str, Process] = dict(zip(configs, started))
            rows = []
            for round_no in range(plan.rounds):
                order = SEQUENTIAL[round_no % 3:] + SEQUENTIAL[:round_no % 3]
                for name in order:
                    send = chat_request(brokers[name].url, sequential_body(uuid.uuid4().hex[:8]))
                    await closed_loop(send, concurrency=1, total=plan.warmup)
                    samples, wall = await closed_loop(send, concurrency=1, total=plan.sequential_requests)
                    rows.append({"round": round_no, "broker": name, **summarize(samples, wall)})
    med = {name: {k: statistics.median(r[k] for r in rows if r["broker"] == name) for k in ("rps", "p50_ms", "p99_ms")}
           for name in SEQUENTIAL}
    for name in ("adaptive", "fixed"):
        med[name]["added_p50_ms"] = statistics.median(
            a["p50_ms"] - p["p50_ms"] for a, p in _paired(rows, name, "passthrough"))
    return {"runs": rows, "summary": med, "errors": sum(r["requests"] - r["ok"] for r in rows)}


def _paired(rows: list[dict[str, Any]], a: str, b: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    by_round: dict[int, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_round.setdefault(r["round"], {})[r["broker"]] = r
    return [(t[a], t[b]) for t in by_round.values() if a in t and b in t]


def savings(run: dict[str, Any]) -> float:
    """Share of requests that cost no upstream call of their own."""
    return 1.0 - run["upstream_calls"] / run["requests"] if run["requests"] else 0.0


async def call_savings(plan: Plan) -> dict[str, Any]:
    """Part 2: the batch mix at `mix_rate` and standard bursts, adaptive beside fixed windows."""
    from bench.merging import SIM_OPTIONS

    sim = await start_simulator(*SIM_OPTIONS)
    try:
        mix = mixed_workload(plan.mix_requests, seed=1)
        count = min(plan.bursts, hot_question_topics())
        burst_items = [item for b in range(count) for item in hot_question_versions(b, plan.burst_versions)]
        scenarios = {"batch mix": ("batch", mix, poisson(plan.mix_rate, len(mix))),
                     "standard bursts": ("standard", burst_items, bursts(count, plan.burst_versions, 0.1, 0.3))}
        out: dict[str, Any] = {}
        for name, (tier, items, drive) in scenarios.items():
            runs = {}
            for policy in ("fixed", "adaptive"):
                spec = RunSpec(f"{name}, {policy}", tier)
                config = with_window_policy(merging_config(sim.url, spec), policy)
                runs[policy] = await measure(sim, spec, items, drive, config=config)
            kept = savings(runs["adaptive"]) / savings(runs["fixed"]) if savings(runs["fixed"]) else 0.0
            out[name] = {"tier": tier, "requests": len(items), "runs": {p: _slim(r) for p, r in runs.items()},
                         "savings": {p: savings(r) for p, r in runs.items()}, "savings_kept": kept}
        return out
    finally:
        sim.stop()


EARLY_SIM = ("--latency-base-ms", "100", "--latency-per-token-ms", "4")  # a steady 250 tokens/s after 100 ms
EARLY_BATCH = 4


def early_config(upstream: str, early: bool) -> dict[str, Any]:
    """One batch tier that merges any `EARLY_BATCH` requests sent together; early release on or off."""
    return {"providers": [{"name": "sim", "base_url": upstream, "early_release": early, "max_connections": 64}],
            "merge": {"embedder": "none"}, "cache": {"enabled": False}, "default_tier": "batch",
            "tiers": [{"name": "batch", "window_ms": 100, "max_batch": EARLY_BATCH, "similarity_threshold": 0.0,
                       "window_policy": "fixed"}]}


async def early_release(plan: Plan) -> dict[str, Any]:
    """Part 3: batches of `EARLY_BATCH` distinct prompts sent together, to the simulator directly and to two
    brokers (early release on, off), in rotating order; each member's latency over its direct latency."""
    async with processes_together(start_simulator(*EARLY_SIM)) as (sim,):
        upstream = sim_base_url(sim)
        async with processes_together(start_broker(early_config(upstream, True)),
                                      start_broker(early_config(upstream, False))) as (early, whole):
            urls = {"direct": upstream.removesuffix("/v1"), "early": early.url, "whole": whole.url}
            latencies: dict[str, list[float]] = {name: [] for name in urls}
            merged: dict[str, list[bool]] = {name: [] for name in urls}
            errors = dict.fromkeys(urls, 0)
            for batch in range(plan.early_batches):
                run_id = uuid.uuid4().hex[:8]
                order = list(urls)[batch % 3:] + list(urls)[:batch % 3]
                for name in order:
                    send = chat_request(urls[name], sequential_body(run_id))
                    async with aiohttp.ClientSession() as session:
                        samples = await asyncio.gather(*(send(session, i) for i in range(EARLY_BATCH)))
                    latencies[name] += [s.latency_s * 1000 for s in samples]
                    merged[name] += [s.headers.get("X-Broker-Batch-Size", "1") != "1" for s in samples]
                    errors[name] += sum(1 for s in samples if s.status != 200)
    return summarize_early(latencies, merged, errors)


def summarize_early(latencies: dict[str, list[float]], merged: dict[str, list[bool]],
                    errors: dict[str, int]) -> dict[str, Any]:
    """Mean member latency and mean added over direct (same prompt, same batch), for each release mode."""
    direct = latencies["direct"]
    out: dict[str, Any] = {"direct_mean_ms": statistics.fmean(direct) if direct else 0.0,
                           "description": f"Batches of {EARLY_BATCH} distinct prompts sent together, to the simulator "
                           f"directly and to two brokers (early release on and off) in rotating order; the simulator "
                           f"answers after {EARLY_SIM[1]} ms and then streams at {EARLY_SIM[3]} ms per token. Added "
                           f"latency is each merged member's latency minus the same prompt's direct latency."}
    for mode in ("early", "whole"):
        pairs = [(ms, d) for ms, d, m in zip(latencies[mode], direct, merged[mode]) if m]
        added = [ms - d for ms, d in pairs]
        out[mode] = {"mean_ms": statistics.fmean(ms for ms, _ in pairs) if pairs else 0.0,
                     "added_ms": statistics.fmean(added) if added else 0.0,
                     "p99_ms": percentile([ms for ms, _ in pairs], 99) if pairs else 0.0,
                     "merged_share": sum(merged[mode]) / len(merged[mode]) if merged[mode] else 0.0,
                     "errors": errors[mode]}
    whole = out["whole"]["added_ms"]
    out["cut"] = 1 - out["early"]["added_ms"] / whole if whole > 0 else 0.0
    return out


async def first_token_ms(session: aiohttp.ClientSession, url: str, question: str) -> float | None:
    """Milliseconds from sending a streaming request to its first content chunk (None: no content came)."""
    body = {"model": "sim-small", "stream": True, "messages": [{"role": "user", "content": question}]}
    started = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        async for line in resp.content:
            if line.startswith(b"data: {") and b'"content":"' in line.replace(b'": "', b'":"') \
                    and b'"content":""' not in line.replace(b'": "', b'":"'):
                first = (time.perf_counter() - started) * 1000
                await resp.read()
                return first
    return None


async def merged_streams(plan: Plan) -> dict[str, Any]:
    """Part 4: batches of `EARLY_BATCH` streaming requests sent together to a batch-tier broker (merge_streams
    on) and directly to the simulator; time to first token, and the broker's own figure by batch position."""
    from bench.merging import scrape, total

    async with processes_together(start_simulator(*EARLY_SIM)) as (sim,):
        upstream = sim_base_url(sim)
        async with processes_together(start_broker(early_config(upstream, True))) as (broker,):
            urls = {"direct": upstream.removesuffix("/v1"), "merged": broker.url}
            ttft: dict[str, list[float]] = {name: [] for name in urls}
            async with aiohttp.ClientSession() as session:
                for _ in range(plan.early_batches):
                    for name, url in urls.items():
                        questions = [f"stream {uuid.uuid4().hex[:8]} question {i}" for i in range(EARLY_BATCH)]
                        got = await asyncio.gather(*(first_token_ms(session, url, q) for q in questions))
                        ttft[name] += [ms for ms in got if ms is not None]
            metrics = await scrape(broker.url)
    by_position = {}
    for position in range(1, EARLY_BATCH + 1):
        count = total(metrics, "mergebroker_merged_stream_ttft_seconds_count", position=str(position))
        seconds = total(metrics, "mergebroker_merged_stream_ttft_seconds_sum", position=str(position))
        by_position[str(position)] = {"members": count, "mean_ms": 1000 * seconds / count if count else None}
    return {"batch": EARLY_BATCH, "client_ttft_ms": {n: {"mean": statistics.fmean(v) if v else None,
                                                        "p50": percentile(v, 50) if v else None,
                                                        "requests": len(v)} for n, v in ttft.items()},
            "broker_ttft_by_position": by_position}


def _slim(run: dict[str, Any]) -> dict[str, Any]:
    keys = ("requests", "errors", "wrong_answers", "upstream_calls", "merged_calls", "mean_batch_size", "p50_ms",
            "p99_ms", "mean_ms", "queue_wait_ms_mean", "cache_hit_rate", "coalesced_rate")
    return {k: run[k] for k in keys}


async def run(plan: Plan, parts: Sequence[str] = PARTS) -> dict[str, Any]:
    """Every part of `plan` asked for, as the JSON-ready dict written to `latency.json`."""
    started, probe = time.perf_counter(), cpu_probe_ms()
    result: dict[str, Any] = {"plan": asdict(plan)}
    if "sequential" in parts:
        result["sequential"] = await sequential(plan)
    if "savings" in parts:
        result["savings"] = await call_savings(plan)
    if "early_release" in parts:
        result["early_release"] = await early_release(plan)
    if "merged_streams" in parts:
        result["merged_streams"] = await merged_streams(plan)
    result["meta"] = run_meta(started, probe)
    return result


def report(result: dict[str, Any]) -> str:
    """The printed tables."""
    lines = []
    if "sequential" in result:
        s = result["sequential"]["summary"]
        rows = [{"broker": n, **{k: round(v, 3) for k, v in s[n].items()}} for n in SEQUENTIAL]
        lines += ["Sequential client (medians over rounds)", format_table(rows, ["broker", "rps", "p50_ms", "p99_ms",
                                                                                "added_p50_ms"]), ""]
    for name, part in result.get("savings", {}).items():
        rows = [{"policy": p, **part["runs"][p], "savings": round(part["savings"][p], 3)} for p in part["runs"]]
        lines += [f"{name}: adaptive keeps {part['savings_kept']:.3f} of fixed's call savings",
                  format_table(rows, ["policy", "requests", "upstream_calls", "savings", "mean_batch_size", "p50_ms",
                                      "p99_ms", "errors", "wrong_answers"]), ""]
    if "early_release" in result:
        e = result["early_release"]
        rows = [{"release": m, **{k: round(v, 2) for k, v in e[m].items()}} for m in ("whole", "early")]
        lines += [f"Early release: merged members' added latency over direct cut by {e['cut']:.3f} "
                  f"(direct mean {e['direct_mean_ms']:.1f} ms)",
                  format_table(rows, ["release", "mean_ms", "added_ms", "p99_ms", "merged_share", "errors"]), ""]
    if "merged_streams" in result:
        m = result["merged_streams"]
        rows = [{"position": p, **v} for p, v in m["broker_ttft_by_position"].items()]
        lines += [f"Merged streams, batches of {m['batch']}: client TTFT {m['client_ttft_ms']}",
                  format_table(rows, ["position", "members", "mean_ms"]), ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print its tables and write its JSON."""
    parser = argparse.ArgumentParser(prog="python -m bench.latency", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny run (seconds), for the smoke test")
    parser.add_argument("--part", action="append", choices=PARTS, help="run only these parts")
    parser.add_argument("--out", default=str(results_path("latency.json")), help="JSON output file")
    args = parser.parse_args(argv)
    result = asyncio.run(run(QUICK if args.quick else FULL, args.part or PARTS))
    publish(result, report(result), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
