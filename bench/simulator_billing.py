"""What OpenAI-style billing costs the simulated upstream, and what its prompt cache does to the bill.

One in-process simulator, switched between `billing: none` (the baseline: plain usage, no cache) and
`billing: openai` (prompt cache by prefix, cached tokens in usage) before each round, rounds alternating.
The load: `concurrency` clients sending chat calls that share one ~2,400-token system prompt with a unique
question each, as a support bot does. Per arm: calls/s, median latency, the CPU cost per call of pricing
it (`Biller.charge`, measured apart from the server), the share of prompt tokens billed as cached and the
bill in dollars at gpt-4o prices; ratios are against the baseline.

    python -m bench.simulator_billing [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from bench.harness import format_table, publish, results_path, run_meta
from mergebroker.providers.simulator.billing import Biller
from mergebroker.providers.simulator.faults import SimulatorConfig
from mergebroker.providers.simulator.server import RunningSimulator, start_simulator

SYSTEM = " ".join(f"Rule {i}: answer politely, cite the handbook section {i}, and never guess." for i in range(130))
ARMS = {"none": {"billing": "none"}, "openai": {"billing": "openai"}}


def _body(i: int) -> dict[str, Any]:
    return {"model": "sim-small", "max_tokens": 200,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}: why?"}]}


async def _round(sim: RunningSimulator, arm: str, requests: int, concurrency: int, offset: int) -> dict[str, Any]:
    sim.set_faults(**ARMS[arm])
    sim.reset_bill()
    latencies: list[float] = []
    queue = iter(range(offset, offset + requests))
    async with aiohttp.ClientSession() as session:
        async def client() -> None:
            for i in queue:
                started = time.perf_counter()
                async with session.post(sim.url + "/chat/completions", json=_body(i),
                                        headers={"Authorization": "Bearer bench"}) as resp:
                    assert resp.status == 200, await resp.text()
                    await resp.read()
                latencies.append(time.perf_counter() - started)

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    bill = sim.bill()
    return {"calls_per_s": requests / elapsed, "median_ms": statistics.median(latencies) * 1000,
            "cached_share": bill["cached_tokens"] / bill["prompt_tokens"], "usd": bill["usd"]}


def _charge_us(arm: str, calls: int) -> float:
    """Microseconds of CPU to bill one call (count, and in "openai" mode the cache lookup), outside the server."""
    biller, config = Biller(), SimulatorConfig(**ARMS[arm])
    started = time.process_time()
    for i in range(calls):
        biller.charge(_body(i)["messages"], 80, {"Authorization": "Bearer bench"}, config)
    return (time.process_time() - started) / calls * 1e6


async def run(requests: int, rounds: int, concurrency: int) -> dict[str, Any]:
    started = time.perf_counter()
    samples: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    async with await start_simulator() as sim:
        for r in range(rounds):
            for arm in (ARMS if r % 2 == 0 else reversed(ARMS)):  # alternate who goes first
                samples[arm].append(await _round(sim, arm, requests, concurrency, offset=r * requests))
    rows = []
    for arm, runs in samples.items():
        row = {"billing": arm, **{k: statistics.median(s[k] for s in runs) for k in runs[0]},
               "charge_us": _charge_us(arm, requests)}
        rows.append(row)
    base = rows[0]
    for row in rows:
        for key in ("calls_per_s", "median_ms", "charge_us", "usd"):
            row[key + "_ratio"] = row[key] / base[key]
    return {"meta": run_meta(started), "requests": requests, "rounds": rounds, "concurrency": concurrency,
            "rows": rows}


def report(result: dict[str, Any]) -> str:
    columns = ["billing", "calls_per_s", "calls_per_s_ratio", "median_ms", "median_ms_ratio", "charge_us",
               "charge_us_ratio", "cached_share", "usd", "usd_ratio"]
    return format_table(result["rows"], columns)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.simulator_billing", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke-sized runs")
    parser.add_argument("--out", default=results_path("simulator_billing.json"))
    args = parser.parse_args(argv)
    requests, rounds = (100, 2) if args.quick else (400, 4)
    result = asyncio.run(run(requests, rounds, concurrency=8))
    publish(result, report(result), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
