"""Merged calls in front of upstreams that do not stream, side by side with one that does.

One simulator process; before each run it is set to stream, or to one quirk of OpenAI-compatible servers
that do not (`ignore_stream`: a JSON body answers a streamed request; `reject_stream_options`,
`reject_stream`: a 400 naming the field). Each quirk gets its own broker process (what a provider learns
of its upstream stays with it), with early release on as by default for the `openai` kind. The load is the
issue's probe: batch-tier requests, all different, from concurrent clients. Per run: errors, merge rate,
mean batch size, upstream calls and latency, the breaker's state at the end; ratios are against the
streaming upstream, run for run.

    python -m bench.non_streaming [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from bench.harness import (
    Process,
    chat_request,
    closed_loop,
    cpu_probe_ms,
    format_table,
    get_json,
    median_of_measured,  # the one NaN-skipping median of the paired benchmarks
    post_json,
    processes_together,
    publish,
    results_path,
    run_meta,
    set_faults,
    sim_base_url,
    start_broker,
    start_simulator,
    summarize,
    warm_up,
)

QUIRKS = {"streams": {}, "ignore_stream": {"ignore_stream": True},
          "reject_stream_options": {"reject_stream_options": True}, "reject_stream": {"reject_stream": True}}
_OFF = {"ignore_stream": False, "reject_stream_options": False, "reject_stream": False}


@dataclass(frozen=True)
class Plan:
    """`requests` per run from `concurrency` clients, `rounds` times; the simulator's latency per call and token."""

    concurrency: int
    requests: int
    rounds: int
    latency_base_ms: float = 100.0
    latency_per_token_ms: float = 1.0


FULL = Plan(24, 72 * 4, rounds=3)
QUICK = Plan(8, 16, rounds=1, latency_base_ms=20.0, latency_per_token_ms=0.0)


def broker_config(sim: Process) -> dict[str, Any]:
    """One OpenAI-kind provider (early release on, its default), merging in the batch tier, no cache."""
    return {"providers": [{"name": "sim", "base_url": sim_base_url(sim)}], "merge": {"embedder": "none"},
            "cache": {"enabled": False}}


def body_for(run_id: str):  # type: ignore[no-untyped-def]
    """Distinct batch-tier questions per run (nothing coalesces or hits a cache)."""
    def make(i: int) -> tuple[dict[str, Any], dict[str, str], str]:
        body = {"model": "sim-small", "messages": [{"role": "user", "content": f"[{run_id}] summarise part {i}"}]}
        return body, {"X-Broker-Tier": "batch"}, ""
    return make


async def measured_run(quirk: str, broker: Process, sim: Process, plan: Plan, round_no: int) -> dict[str, Any]:
    """One run of `plan.requests` against `broker` while the simulator has `quirk`."""
    await set_faults(sim, **{**_OFF, **QUIRKS[quirk]}, latency_base_ms=plan.latency_base_ms,
                     latency_per_token_ms=plan.latency_per_token_ms)
    before = (await get_json(sim.url + "/stats"))["chat_calls"]
    samples, wall = await closed_loop(chat_request(broker.url, body_for(uuid.uuid4().hex[:8])),
                                      concurrency=plan.concurrency, total=plan.requests)
    calls = (await get_json(sim.url + "/stats"))["chat_calls"] - before
    sizes = [int(s.headers.get("X-Broker-Batch-Size", "1")) for s in samples if s.status == 200]
    stats = await get_json(broker.url + "/v1/broker/stats")
    return {"quirk": quirk, "round": round_no, **summarize(samples, wall), "upstream_calls": calls,
            "mean_batch_size": sum(sizes) / len(sizes) if sizes else 0.0,
            "members_per_call": len(samples) / calls if calls else 0.0,
            "breaker": stats["providers"]["sim"]["state"]}


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per quirk: medians over rounds, errors summed, and ratios to the streaming upstream of the same round."""
    out: dict[str, Any] = {}
    base = {r["round"]: r for r in rows if r["quirk"] == "streams"}
    for quirk in QUIRKS:
        runs = [r for r in rows if r["quirk"] == quirk]
        out[quirk] = {k: median_of_measured([r[k] for r in runs]) for k in ("mean_batch_size", "members_per_call",
                                                                 "upstream_calls", "p50_ms", "p99_ms")}
        out[quirk]["errors"] = sum(r["requests"] - r["ok"] for r in runs)
        out[quirk]["breaker"] = ",".join(sorted({r["breaker"] for r in runs}))
        for key in ("members_per_call", "p50_ms"):
            out[quirk][f"{key}_vs_streams"] = median_of_measured([r[key] / base[r["round"]][key] for r in runs
                                                       if base[r["round"]][key]])
    return out


async def run(plan: Plan) -> dict[str, Any]:
    """Start the simulator and one broker per quirk; run the quirks in rotating order each round."""
    started, probe = time.perf_counter(), cpu_probe_ms()
    async with processes_together(start_simulator("--latency-base-ms", "0")) as (sim,):
        async with processes_together(*(start_broker(broker_config(sim)) for _ in QUIRKS)) as brokers:
            targets = list(zip(QUIRKS, brokers))
            for quirk, broker in targets:  # first calls (connections, learning the quirk) stay out of the runs
                await set_faults(sim, **{**_OFF, **QUIRKS[quirk]})
                await warm_up(broker.url, body_for("warm-up"))
            rows = []
            for round_no in range(plan.rounds):
                shift = round_no % len(targets)
                for quirk, broker in targets[shift:] + targets[:shift]:
                    rows.append(await measured_run(quirk, broker, sim, plan, round_no))
            await post_json(sim.url + "/control/faults", _OFF)
    return {"plan": asdict(plan), "runs": rows, "summary": summary(rows), "meta": run_meta(started, probe)}


def report(result: dict[str, Any]) -> str:
    """The printed table: per quirk, with the ratios against the streaming upstream."""
    columns = ("errors", "breaker", "mean_batch_size", "members_per_call", "members_per_call_vs_streams",
               "upstream_calls", "p50_ms", "p50_ms_vs_streams", "p99_ms")
    rows = [{"upstream": quirk, **{c: s[c] for c in columns}} for quirk, s in result["summary"].items()]
    return format_table(rows, ["upstream", *columns])


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print its table and write its JSON."""
    parser = argparse.ArgumentParser(prog="python -m bench.non_streaming", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny run (seconds), for the smoke test")
    parser.add_argument("--out", default=str(results_path("non_streaming.json")), help="JSON output file")
    args = parser.parse_args(argv)
    result = asyncio.run(run(QUICK if args.quick else FULL))
    publish(result, report(result), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
