"""Provider-kind overhead: one broker passthrough over an OpenAI, an Anthropic and an Azure upstream, side by side.

One simulator process speaks all three protocols; three broker processes (merging and caching off) differ
only in their provider's `kind`, so the difference between them is what translating costs. Closed loop,
plain and streamed requests, in rounds whose kind order rotates; each figure is the median over rounds
and each ratio the median of per-round (paired) ratios against the `openai` kind.

    python -m bench.provider_kinds [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

from bench.harness import (
    CpuWindow,
    Process,
    RequestFn,
    Sample,
    chat_request,
    closed_loop,
    cpu_probe_ms,
    format_table,
    median_of_measured,  # the one NaN-skipping median of the paired benchmarks
    processes_together,
    publish,
    results_path,
    run_meta,
    sim_base_url,
    start_broker,
    start_simulator,
    summarize,
)

KINDS = ("openai", "anthropic", "azure")
MODES = ("plain", "stream")
KEY_ENV = "MB_BENCH_UPSTREAM_KEY"  # the simulator's Anthropic and Azure modes want a key, any key


@dataclass(frozen=True)
class Plan:
    """`requests` measured requests per run at `concurrency`, after `warmup` unmeasured, `rounds` times."""

    concurrency: int
    requests: int
    warmup: int
    rounds: int


FULL = Plan(16, 1500, 100, rounds=3)
QUICK = Plan(4, 12, 2, rounds=1)


def broker_config(kind: str, sim: Process) -> dict[str, Any]:
    """A passthrough broker whose one provider reaches the simulator as `kind`."""
    provider: dict[str, Any] = {"name": "sim", "base_url": sim_base_url(sim)}
    if kind == "anthropic":
        provider.update(kind="anthropic", api_key_env=KEY_ENV)
    elif kind == "azure":
        provider.update(kind="azure", base_url=sim.url, api_key_env=KEY_ENV)
    return {"providers": [provider], "merge": {"enabled": False}, "cache": {"enabled": False}}


def body_for(run_id: str, stream: bool):  # type: ignore[no-untyped-def]
    """Distinct prompts per run and index (nothing coalesces), streamed or not."""
    def make(i: int) -> tuple[dict[str, Any], dict[str, str], str]:
        body = {"model": "sim-small", "messages": [{"role": "user", "content": f"kinds {run_id} {i}: why?"}]}
        return ({**body, "stream": True} if stream else body), {}, ""

    return make


def stream_request(url: str, body_for_i: Any) -> RequestFn:
    """Post a streaming request and read it to the end; status 200 only when the stream ended in `[DONE]`."""
    async def send(session: aiohttp.ClientSession, i: int) -> Sample:
        body, headers, tag = body_for_i(i)
        started = time.perf_counter()
        async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
            raw = await resp.read()
            status = resp.status if raw.rstrip().endswith(b"data: [DONE]") else 599
            return Sample(time.perf_counter() - started, status, {}, None, tag)

    return send


async def measured_run(kind: str, broker: Process, mode: str, plan: Plan, round_no: int) -> dict[str, Any]:
    """One closed-loop run of one mode against one kind's broker."""
    make = body_for(uuid.uuid4().hex[:8], mode == "stream")
    send = stream_request(broker.url, make) if mode == "stream" else chat_request(broker.url, make)
    await closed_loop(send, concurrency=plan.concurrency, total=plan.warmup)
    cpu = CpuWindow(broker)
    samples, wall = await closed_loop(send, concurrency=plan.concurrency, total=plan.requests)
    return {"round": round_no, "mode": mode, "kind": kind, **summarize(samples, wall),
            "cpu_ms_per_req": cpu.ms_per(len(samples))}


def summarize_mode(rows: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    """Medians per kind and paired ratios against the openai kind, for one mode."""
    by_round: dict[int, dict[str, dict[str, Any]]] = {}
    for r in rows:
        if r["mode"] == mode:
            by_round.setdefault(r["round"], {})[r["kind"]] = r
    rounds = [t for t in by_round.values() if set(KINDS) <= set(t)]
    out: dict[str, Any] = {"mode": mode, "rounds": len(rounds)}
    for kind in KINDS:
        out[kind] = {k: median_of_measured([t[kind][k] for t in rounds]) for k in ("rps", "p50_ms", "p99_ms", "cpu_ms_per_req")}
        out[kind]["errors"] = sum(t[kind]["requests"] - t[kind]["ok"] for t in rounds)
        if kind != "openai":
            out[f"{kind}_vs_openai_rps"] = median_of_measured([t[kind]["rps"] / t["openai"]["rps"] for t in rounds])
            out[f"{kind}_vs_openai_cpu"] = median_of_measured([t[kind]["cpu_ms_per_req"] / t["openai"]["cpu_ms_per_req"]
                                                    for t in rounds if t["openai"]["cpu_ms_per_req"]])
            out[f"{kind}_added_p50_ms"] = median_of_measured([t[kind]["p50_ms"] - t["openai"]["p50_ms"] for t in rounds])
    return out


async def run(plan: Plan) -> dict[str, Any]:
    """Start the simulator and one broker per kind; run every mode in rotating rounds; return the results."""
    started, probe = time.perf_counter(), cpu_probe_ms()
    os.environ.setdefault(KEY_ENV, "bench-key")  # inherited by the broker processes, never printed
    async with processes_together(start_simulator("--latency-base-ms", "0")) as (sim,):
        async with processes_together(*(start_broker(broker_config(k, sim)) for k in KINDS)) as brokers:
            targets = list(zip(KINDS, brokers))
            rows = []
            for round_no in range(plan.rounds):
                for m, mode in enumerate(MODES):
                    shift = (round_no + m) % len(targets)
                    for kind, broker in targets[shift:] + targets[:shift]:
                        rows.append(await measured_run(kind, broker, mode, plan, round_no))
    return {"plan": asdict(plan), "runs": rows, "summary": {m: summarize_mode(rows, m) for m in MODES},
            "meta": run_meta(started, probe)}


def report(result: dict[str, Any]) -> str:
    """The printed table: per mode and kind, with the paired ratios against the openai kind."""
    rows = [{"mode": mode, "kind": kind, **{k: s[kind][k] for k in ("rps", "p50_ms", "p99_ms", "cpu_ms_per_req",
                                                                     "errors")},
             "rps_vs_openai": s.get(f"{kind}_vs_openai_rps", 1.0), "cpu_vs_openai": s.get(f"{kind}_vs_openai_cpu", 1.0)}
            for mode, s in result["summary"].items() for kind in KINDS]
    return format_table(rows, list(rows[0]))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print its table and write its JSON."""
    parser = argparse.ArgumentParser(prog="python -m bench.provider_kinds", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny run (seconds), for the smoke test")
    parser.add_argument("--out", default=str(results_path("provider_kinds.json")), help="JSON output file")
    args = parser.parse_args(argv)
    result = asyncio.run(run(QUICK if args.quick else FULL))
    publish(result, report(result), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
