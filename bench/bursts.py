"""Bursts under load: hot-question bursts on the standard tier, on a quiet host and on a host kept busy.

The workload is issue 25's: 5 bursts of 30 decorated versions of one hot question each (a greeting, a
thank-you), sent to the standard tier with default settings, against `mergebroker simulate
--latency-base-ms 300`. The broker, the simulator and this load generator share the host; on the loaded
host two CPU burner processes (pure-Python busy loops) also run, one per core of the 2-core machine, from
just before the first burst to the end of the run. Each configuration runs on a fresh broker: today's
similarity settings of the previous release (the int8 model on onnxruntime on one thread, a 200 ms similarity
budget) beside today's defaults (two model threads, the standard tier's 1 s budget), in interleaved repeats.
Reported per run: upstream calls saved (requests / upstream calls; at most 4, the tier's `max_batch`) and
the share of requests sent unmerged as `similarity_slow` (`mergebroker_merge_skipped_total`).
`python -m bench.bursts [--quick]` writes `bench/results/bursts.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from statistics import median
from typing import Any

import aiohttp
import yaml

from bench.harness import (
    Process,
    chat_request,
    cpu_probe_ms,
    format_table,
    free_port,
    off_loop_seconds,
    post_json,
    publish,
    results_path,
    run_meta,
    start_simulator,
)
from bench.merging import (
    RunSpec,
    body_source,
    broker_config,
    bursts,
    scrape,
    summarize_run,
    warm_up,
)
from bench.report_bursts import DEFAULTS
from bench.workloads import ChatItem, hot_question_versions

SIM_OPTIONS = ("--latency-base-ms", "300")
TIER = "standard"
BURNERS = 2
BURNER_LIMIT_S = 600  # a burner stops by itself even if this process dies first


@dataclass(frozen=True)
class BurstPlan:
    """Sizes of the bursts benchmark; `QUICK_BURST_PLAN` is a smoke-sized copy."""

    bursts: int = 5
    per_burst: int = 30
    spread_s: float = 0.1
    gap_s: float = 0.3
    repeats: int = 3
    hosts: tuple[str, ...] = ("quiet", "loaded")
    onnx_threads: tuple[int, ...] = ()  # extra runs of the onnxruntime copy with `embeddings.model_threads` > 1


FULL_BURST_PLAN = BurstPlan()
QUICK_BURST_PLAN = BurstPlan(bursts=1, per_burst=8, repeats=1)


@dataclass(frozen=True)
class Backend:
    """A similarity configuration: its name, the `merge.embedder` value, and overrides of the model's threads
    (`embeddings.model_threads`) and the tier's `similarity_budget_ms` (None: the defaults)."""

    name: str
    embedder: str = "local-onnx"
    threads: int | None = None
    budget_ms: float | None = None


def backends(plan: BurstPlan) -> tuple[Backend, ...]:
    """The previous release's similarity settings beside today's defaults (and extra thread counts)."""
    more = [Backend(f"defaults, {n} model threads", threads=n) for n in plan.onnx_threads]
    return Backend("before: 1 model thread, 200 ms budget", threads=1, budget_ms=200.0), Backend(DEFAULTS), *more


def burst_items(plan: BurstPlan) -> list[ChatItem]:
    """One hot question per burst (so no answer is cached across bursts), `per_burst` versions of each."""
    return [item for b in range(plan.bursts) for item in hot_question_versions(b, plan.per_burst)]


def start_burners(count: int = BURNERS) -> list[subprocess.Popen[bytes]]:
    """`count` processes that keep one core each busy (for at most `BURNER_LIMIT_S`)."""
    loop = f"import time\nend = time.monotonic() + {BURNER_LIMIT_S}\nwhile time.monotonic() < end:\n    pass\n"
    return [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(count)]


def stop_burners(burners: list[subprocess.Popen[bytes]]) -> None:
    """End the burners this benchmark started."""
    for proc in burners:
        proc.terminate()
    for proc in burners:
        proc.wait(timeout=10)


async def start_broker_with(config: dict[str, Any]) -> Process:
    """`python -m mergebroker.broker.cli serve --config ...` on a free port; waits for /readyz,
    which includes the similarity model (and its ONNX export on a first start)."""
    port = free_port()
    config = {**config, "server": {"port": port, "host": "127.0.0.1"}, "logging": {"level": "warning"}}
    workdir = Path(tempfile.mkdtemp(prefix="mb-bench-bursts-"))
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    command = [sys.executable, "-m", "mergebroker.broker.cli", "serve", "--config", str(workdir / "config.yaml")]
    proc = subprocess.Popen(command,
                            stdout=(workdir / "out.log").open("wb"), stderr=subprocess.STDOUT, env=env,
                            cwd=Path(__file__).resolve().parent.parent)
    broker = Process(proc, port, workdir / "out.log")
    deadline = time.monotonic() + 300
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                async with session.get(broker.url + "/readyz") as resp:
                    if resp.status == 200:
                        return broker
            except (aiohttp.ClientError, OSError):
                pass
            await asyncio.sleep(0.2)  # a child process's readiness has no event to wait on
    broker.stop()
    raise RuntimeError(f"broker did not become ready; see {broker.log_path}")


async def measure(sim: Process, backend: Backend, loaded: bool, plan: BurstPlan) -> dict[str, Any]:
    """One run on a fresh broker: warm up on a quiet host, start the burners (if `loaded`), drive the bursts."""
    spec = RunSpec(f"{backend.name}, {'loaded' if loaded else 'quiet'} host", TIER, embedder=backend.embedder,
                   similarity_budget_ms=backend.budget_ms)
    items = burst_items(plan)
    config = broker_config(sim.url, spec)
    if backend.threads is not None:
        config["embeddings"] = {"model_threads": backend.threads}
    broker = await start_broker_with(config)
    burners: list[subprocess.Popen[bytes]] = []
    try:
        await warm_up(broker.url, TIER)
        before, cpu_before, model_before = await scrape(broker.url), broker.cpu(), off_loop_seconds(broker.proc.pid)
        await post_json(sim.url + "/stats/reset", {})
        burners = start_burners() if loaded else []
        drive = bursts(plan.bursts, plan.per_burst, plan.spread_s, plan.gap_s)
        samples, wall_s = await drive(chat_request(broker.url, body_source(items, TIER), keep_body=True))
        load = os.getloadavg()[0]
        stop_burners(burners)
        burners = []
        cpu_s, model_cpu_s = broker.cpu() - cpu_before, off_loop_seconds(broker.proc.pid) - model_before
        after = await scrape(broker.url)
        async with aiohttp.ClientSession() as session:
            async with session.get(sim.url + "/stats") as resp:
                sim_stats = await resp.json()
    finally:
        stop_burners(burners)
        broker.stop()
    figures = summarize_run(spec, samples, wall_s, before, after, sim_stats, cpu_s, model_cpu_s)
    figures.pop("latency_cdf_ms")
    calls = figures["upstream_calls"]
    return {**figures, "backend": backend.name, "host": "loaded" if loaded else "quiet", "load_average": load,
            "x_fewer_calls": figures["requests"] / calls if calls else None}


async def run(plan: BurstPlan = FULL_BURST_PLAN) -> dict[str, Any]:
    """Every configuration of `plan`, repeats interleaved, as the JSON-ready dict written to `bursts.json`."""
    started, probe = time.perf_counter(), cpu_probe_ms()
    sim = await start_simulator(*SIM_OPTIONS)
    runs = []
    try:
        for _ in range(plan.repeats):
            for loaded in (host == "loaded" for host in plan.hosts):
                for backend in backends(plan):
                    runs.append(await measure(sim, backend, loaded, plan))
    finally:
        sim.stop()
    return {"runs": runs, "summary": summarize(runs),
            "meta": {"plan": asdict(plan), "simulator_options": list(SIM_OPTIONS), "tier": TIER, "burners": BURNERS,
                     **run_meta(started, probe)}}


def summarize(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per backend and host: the median over repeats of calls saved and `similarity_slow` share, with the worst."""
    rows = []
    for host in ("quiet", "loaded"):
        for name in dict.fromkeys(r["backend"] for r in runs):
            mine = [r for r in runs if r["backend"] == name and r["host"] == host]
            if not mine:
                continue
            fewer = [r["x_fewer_calls"] or 0.0 for r in mine]
            slow = [r["similarity_slow_rate"] for r in mine]
            rows.append({"host": host, "backend": name, "runs": len(mine), "x_fewer_calls": median(fewer),
                         "worst_x_fewer_calls": min(fewer), "similarity_slow": median(slow),
                         "worst_similarity_slow": max(slow),
                         "embedding_cpu_ms_per_request": median(r["embedding_cpu_ms_per_request"] for r in mine),
                         "p99_ms": median(r["p99_ms"] for r in mine),
                         "errors": sum(r["errors"] for r in mine),
                         "wrong_answers": sum(r["wrong_answers"] for r in mine),
                         "load_average": median(r["load_average"] for r in mine)})
    return rows


def format_summary(result: dict[str, Any]) -> str:
    """The printed table: one row per host and backend."""
    rows = [{**r, "similarity_slow": f"{100 * r['similarity_slow']:.1f} %",
             "worst_similarity_slow": f"{100 * r['worst_similarity_slow']:.1f} %"} for r in result["summary"]]
    plan = result["meta"]["plan"]
    head = (f"{plan['bursts']} bursts of {plan['per_burst']} versions of one question, {TIER} tier, upstream "
            f"{SIM_OPTIONS[1]} ms; loaded = {BURNERS} CPU burners; median of {plan['repeats']} runs (worst beside)")
    return head + "\n" + format_table(rows, ["host", "backend", "runs", "x_fewer_calls", "worst_x_fewer_calls",
                                             "similarity_slow", "worst_similarity_slow",
                                             "embedding_cpu_ms_per_request", "p99_ms", "errors", "wrong_answers",
                                             "load_average"])


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m bench.bursts [--quick] [--out FILE]`: run the bursts-under-load benchmark and write its JSON."""
    parser = argparse.ArgumentParser(prog="bench.bursts", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke-sized runs")
    parser.add_argument("--hosts", default="quiet,loaded", help="which hosts to run: quiet, loaded or both")
    parser.add_argument("--onnx-threads", default="", help="extra runs of the defaults with these model threads, e.g. 1,4")
    parser.add_argument("--out", default=str(results_path("bursts.json")))
    args = parser.parse_args(argv)
    plan = replace(QUICK_BURST_PLAN if args.quick else FULL_BURST_PLAN, hosts=tuple(args.hosts.split(",")),
                   onnx_threads=tuple(int(n) for n in args.onnx_threads.split(",") if n))
    result = asyncio.run(run(plan))
    publish(result, format_summary(result), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
