"""Streamed chat through the broker in passthrough: its CPU per stream and time to the first event, against another
checkout's broker side by side.

The clients that matter most (Codex CLI, Claude Code, the SDKs' agents) stream. Each target serves the same
streamed requests (distinct prompts, so nothing coalesces) from one simulator at latency 0, in interleaved
rounds whose order alternates; CPU is the broker process's scheduler run time over a round. The load
generator, the simulator and the brokers share the host's cores.

    python -m bench.streams [--requests 400] [--concurrency 16] [--rounds 3] [--old-checkout PATH] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from bench.harness import (
    CpuWindow,
    Process,
    cpu_vs_old,
    format_table,
    new_and_old,
    passthrough_config,
    percentile,
    processes,
    publish,
    results_path,
    run_meta,
    sim_base_url,
    start_simulator,
)


async def _round(url: str, requests: int, concurrency: int) -> dict[str, Any]:
    """`requests` streamed chat requests, `concurrency` at a time: events relayed, first-event times, errors."""
    events, errors, first_ms = 0, 0, []
    gate = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as session:
        async def one(i: int) -> None:
            nonlocal events, errors
            body = {"model": "sim-small", "stream": True, "max_tokens": 64,
                    "messages": [{"role": "user", "content": f"stream {uuid.uuid4().hex} {i}"}]}
            async with gate:
                started, seen = time.perf_counter(), 0
                async with session.post(url + "/v1/chat/completions", json=body) as resp:
                    errors += resp.status != 200
                    async for line in resp.content:
                        if line.startswith(b"data:"):
                            if not seen:
                                first_ms.append((time.perf_counter() - started) * 1000)
                            seen += 1
                events += seen

        await asyncio.gather(*(one(i) for i in range(requests)))
    return {"events": events, "errors": errors, "first_ms": first_ms}


async def _measure(target: Process, requests: int, concurrency: int) -> dict[str, Any]:
    window = CpuWindow(target)
    result = await _round(target.url, requests, concurrency)
    return {"cpu_ms": window.ms_per(requests), "events_per_stream": result["events"] / requests,
            "errors": result["errors"], "first_event_p50_ms": percentile(result["first_ms"], 50)}


async def run(requests: int, concurrency: int, rounds: int, old_checkout: Path | None) -> dict[str, Any]:
    started = time.perf_counter()
    async with processes(start_simulator("--latency-base-ms", "0")) as (sim,):
        config = passthrough_config(sim_base_url(sim))
        measured = await new_and_old(config, old_checkout, lambda target: _round(target.url, 50, concurrency),
                                     lambda target, _n: _measure(target, requests, concurrency), rounds)
    rows = [{"target": name, "cpu_ms_per_stream": statistics.median(r["cpu_ms"] for r in runs),
             "first_event_p50_ms": statistics.median(r["first_event_p50_ms"] for r in runs),
             "events_per_stream": runs[0]["events_per_stream"], "errors": sum(r["errors"] for r in runs)}
            for name, runs in measured.items()]
    ratios = cpu_vs_old(measured)
    return {"requests": requests, "concurrency": concurrency, "rounds": rounds, "rows": rows, "ratios": ratios,
            "meta": run_meta(started)}


def report(result: dict[str, Any]) -> str:
    lines = [f"Streamed chat in passthrough ({result['requests']} streams at concurrency {result['concurrency']}, "
             f"medians over {result['rounds']} interleaved rounds; CPU: the broker process's)",
             format_table(result["rows"], ["target", "cpu_ms_per_stream", "first_event_p50_ms", "events_per_stream",
                                           "errors"])]
    lines += [f"{name} (paired median): {value:.3f}x" for name, value in result["ratios"].items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run, print the table and write the JSON."""
    parser = argparse.ArgumentParser(prog="python -m bench.streams", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=400, help="streams per target and round")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--old-checkout", type=Path, help="also run that checkout's broker, side by side")
    parser.add_argument("--quick", action="store_true", help="a tiny run (seconds), for the smoke test")
    parser.add_argument("--out", help="JSON output file")
    args = parser.parse_args(argv)
    requests, rounds = (20, 1) if args.quick else (args.requests, args.rounds)
    result = asyncio.run(run(requests, args.concurrency, rounds, args.old_checkout))
    publish(result, report(result), args.out or str(results_path("streams.json")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
