"""Passthrough overhead: the simulator direct vs. a minimal aiohttp proxy vs. mergebroker (no merging, no cache).

Part 1, closed loop: concurrency 1, 16 and 64 against each target with upstream latency 0. Runs go in
rounds whose target order rotates, so that drift on the shared machine hits every target alike; each
figure is the median over rounds and each ratio the median of per-round (paired) ratios.
Part 2, equal load: the same Poisson rate offered to each target, which shows the latency the broker adds
when it is not saturated (in part 1 each target runs at its own saturation, so by Little's law its latency
mostly mirrors its throughput).

    python -m bench.passthrough [--quick] [--tracing] [--out FILE]

`--lone` adds a broker at its defaults (merging, cache and the default tiers on) and gives every request its own
system prompt and temperature 0, so nothing can merge and each answer is looked up in and written to the cache:
the lone-request path, reported against the passthrough broker (issue 36: within 10% of it).

`--tracing` adds a fourth target: a second broker with telemetry on (traces and GenAI metrics over OTLP to an
in-process sink that only counts what it receives), reported beside the broker with telemetry off.

Targets, reported and not enforced: broker throughput >= 0.7x the proxy's, and broker p99 minus direct p99
<= 5 ms, both at concurrency 16; and the hot path's (issue 36): throughput >= 0.8x the proxy's at every
concurrency, and p50 at concurrency 1 within +0.3 ms of the proxy's (paired per round, not over direct).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from bench.harness import (
    CpuWindow,
    Process,
    chat_request,
    closed_loop,
    cpu_probe_ms,
    format_table,
    latency_summary,
    median_of_measured,
    old_checkout_path,
    open_loop,
    passthrough_config,
    processes_together,
    publish,
    results_path,
    run_meta,
    sim_base_url,
    start_broker,
    start_proxy,
    start_simulator,
    summarize,
)

TARGETS = ("direct", "proxy", "broker")
TRACED = "broker_traced"
"""The broker with telemetry on (`--tracing`), compared with "broker" (off)."""
OLD = "broker_old"
"""Another checkout's broker (`--old-checkout`), the baseline a change is measured against side by side."""
LONE = "broker_defaults"
"""The broker at its defaults with nothing to merge (`--lone`), compared with "broker" (passthrough)."""
LONE_RATIO_TARGET = 0.9
THROUGHPUT_RATIO_TARGET = 0.7
ADDED_P99_TARGET_MS = 5.0
TARGET_CONCURRENCY = 16
FLOOR_RATIO_TARGET = 0.8  # throughput against the proxy, at every concurrency
P50_OVER_PROXY_TARGET_MS = 0.3  # at concurrency 1


@dataclass(frozen=True)
class Plan:
    """How much load: `requests[i]` measured requests per run at `concurrencies[i]`, after `warmup` unmeasured."""

    concurrencies: tuple[int, ...]
    requests: tuple[int, ...]
    warmup: int
    rounds: int
    open_rate: float
    open_s: float


FULL = Plan((1, 16, 64), (600, 1500, 2000), warmup=100, rounds=3, open_rate=150.0, open_s=8.0)
QUICK = Plan((1, 16), (8, 24), warmup=2, rounds=1, open_rate=40.0, open_s=0.25)


@dataclass(frozen=True)
class Target:
    """Where requests go, and whose CPU counts as this target's cost."""

    name: str
    url: str
    server: Process


def body_for(run_id: str, *, lone: bool = False) -> Callable[[int], tuple[dict[str, Any], dict[str, str], str]]:
    """Distinct prompts per run and index, so nothing could coalesce even if caching were on. `lone`: each with
    its own system prompt (no two may share a call) and temperature 0 (each is looked up in and written to the
    cache)."""
    def make(i: int) -> tuple[dict[str, Any], dict[str, str], str]:
        text = f"passthrough {run_id} request {i}: what is {i} squared?"
        if lone:
            return {"model": "sim-small", "temperature": 0, "messages": [
                {"role": "system", "content": f"You answer arithmetic, case {run_id}-{i}."},
                {"role": "user", "content": text}]}, {}, ""
        return {"model": "sim-small", "messages": [{"role": "user", "content": text}]}, {}, ""

    return make


async def closed_run(target: Target, sim: Process, concurrency: int, requests: int, warmup: int,
                     round_no: int, *, lone: bool = False) -> dict[str, Any]:
    """One measured closed-loop run against one target."""
    run_id = uuid.uuid4().hex[:8]
    send = chat_request(target.url, body_for(run_id, lone=lone))
    await closed_loop(send, concurrency=concurrency, total=warmup)  # warm code paths and connection pools
    own, upstream = CpuWindow(target.server), CpuWindow(sim)
    samples, wall = await closed_loop(send, concurrency=concurrency, total=requests)
    row = {"round": round_no, "concurrency": concurrency, "target": target.name, **summarize(samples, wall),
           "cpu_ms_per_req": own.ms_per(len(samples)), "sim_cpu_ms_per_req": upstream.ms_per(len(samples))}
    return row


def rotated(items: Sequence[Target], by: int) -> list[Target]:
    """`items` rotated left by `by`: each round starts with a different target."""
    k = by % len(items)
    return [*items[k:], *items[:k]]



def summarize_concurrency(rows: list[dict[str, Any]], concurrency: int,
                          names: Sequence[str] = TARGETS) -> dict[str, Any]:
    """Medians per target and paired ratios/differences for one concurrency level."""
    by_round: dict[int, dict[str, dict[str, Any]]] = {}
    for r in rows:
        if r["concurrency"] == concurrency:
            by_round.setdefault(r["round"], {})[r["target"]] = r
    rounds = [t for t in by_round.values() if set(names) <= set(t)]

    def med(target: str, key: str) -> float:
        return median_of_measured([t[target][key] for t in rounds])

    def paired(fn: Callable[[dict[str, dict[str, Any]]], float]) -> float:
        return median_of_measured([fn(t) for t in rounds])

    out: dict[str, Any] = {"concurrency": concurrency, "rounds": len(rounds)}
    for name in names:
        out[name] = {k: med(name, k) for k in ("rps", "p50_ms", "p99_ms", "cpu_ms_per_req", "sim_cpu_ms_per_req")}
        out[name]["errors"] = sum(t[name]["requests"] - t[name]["ok"] for t in rounds)
    out["broker_vs_proxy_rps"] = paired(lambda t: t["broker"]["rps"] / t["proxy"]["rps"])
    out["broker_vs_direct_rps"] = paired(lambda t: t["broker"]["rps"] / t["direct"]["rps"])
    out["proxy_vs_direct_rps"] = paired(lambda t: t["proxy"]["rps"] / t["direct"]["rps"])
    out["broker_added_p50_ms"] = paired(lambda t: t["broker"]["p50_ms"] - t["direct"]["p50_ms"])
    out["broker_added_p99_ms"] = paired(lambda t: t["broker"]["p99_ms"] - t["direct"]["p99_ms"])
    out["broker_over_proxy_p50_ms"] = paired(lambda t: t["broker"]["p50_ms"] - t["proxy"]["p50_ms"])
    out["proxy_added_p99_ms"] = paired(lambda t: t["proxy"]["p99_ms"] - t["direct"]["p99_ms"])
    out["broker_vs_proxy_cpu"] = paired(lambda t: t["broker"]["cpu_ms_per_req"] / t["proxy"]["cpu_ms_per_req"]
                                        if t["proxy"]["cpu_ms_per_req"] else float("nan"))
    if OLD in names:
        out["old_vs_proxy_rps"] = paired(lambda t: t[OLD]["rps"] / t["proxy"]["rps"])
        out["broker_vs_old_rps"] = paired(lambda t: t["broker"]["rps"] / t[OLD]["rps"])
        out["broker_vs_old_cpu"] = paired(lambda t: t["broker"]["cpu_ms_per_req"] / t[OLD]["cpu_ms_per_req"])
        out["old_added_p50_ms"] = paired(lambda t: t[OLD]["p50_ms"] - t["direct"]["p50_ms"])
        out["old_over_proxy_p50_ms"] = paired(lambda t: t[OLD]["p50_ms"] - t["proxy"]["p50_ms"])
    if TRACED in names:
        out["traced_vs_broker_rps"] = paired(lambda t: t[TRACED]["rps"] / t["broker"]["rps"])
        out["traced_added_p50_ms"] = paired(lambda t: t[TRACED]["p50_ms"] - t["broker"]["p50_ms"])
        out["traced_added_p99_ms"] = paired(lambda t: t[TRACED]["p99_ms"] - t["broker"]["p99_ms"])
        out["traced_added_cpu_ms"] = paired(lambda t: t[TRACED]["cpu_ms_per_req"] - t["broker"]["cpu_ms_per_req"])
    if LONE in names:
        out["lone_vs_broker_rps"] = paired(lambda t: t[LONE]["rps"] / t["broker"]["rps"])
        out["lone_added_p50_ms"] = paired(lambda t: t[LONE]["p50_ms"] - t["broker"]["p50_ms"])
        out["lone_vs_broker_cpu"] = paired(lambda t: t[LONE]["cpu_ms_per_req"] / t["broker"]["cpu_ms_per_req"])
    return out


async def equal_load(targets: list[Target], rate: float, duration_s: float, *, lone: bool = False) -> dict[str, Any]:
    """The same Poisson rate offered to every target; latency and added latency vs direct."""
    result: dict[str, Any] = {"rate": rate, "duration_s": duration_s}
    for target in targets:
        send = chat_request(target.url, body_for(uuid.uuid4().hex[:8], lone=lone))
        own = CpuWindow(target.server)
        samples, wall = await open_loop(send, rate=rate, duration_s=duration_s)
        sent = len(samples)
        lat = latency_summary([s.latency_s * 1000 for s in samples])
        result[target.name] = {"requests": sent, "ok": sum(1 for s in samples if s.status == 200),
                               "achieved_rps": sent / wall if wall else 0.0, **lat,
                               "cpu_ms_per_req": own.ms_per(len(samples))}
    for name in [t.name for t in targets if t.name != "direct"]:
        result[f"{name}_added_p50_ms"] = result[name]["p50_ms"] - result["direct"]["p50_ms"]
        result[f"{name}_added_p99_ms"] = result[name]["p99_ms"] - result["direct"]["p99_ms"]
    return result


def verdict(summary: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets against the measured figures at concurrency 16 (or the nearest level run)."""
    level = min(summary, key=lambda c: abs(int(c) - TARGET_CONCURRENCY))
    s = summary[level]
    lowest = summary[min(summary, key=int)]
    floor = {c: v["broker_vs_proxy_rps"] for c, v in summary.items()}
    return {"concurrency": int(level),
            "floor_ratio_target": FLOOR_RATIO_TARGET, "floor_ratios": floor,
            "floor_ok": all(r >= FLOOR_RATIO_TARGET for r in floor.values()),
            "p50_over_proxy_concurrency": lowest["concurrency"],
            "p50_over_proxy_ms": lowest["broker_over_proxy_p50_ms"], "p50_over_proxy_target_ms": P50_OVER_PROXY_TARGET_MS,
            "p50_over_proxy_ok": lowest["broker_over_proxy_p50_ms"] <= P50_OVER_PROXY_TARGET_MS,
            "throughput_ratio": s["broker_vs_proxy_rps"], "throughput_ratio_target": THROUGHPUT_RATIO_TARGET,
            "throughput_ok": s["broker_vs_proxy_rps"] >= THROUGHPUT_RATIO_TARGET,
            "added_p99_ms": s["broker_added_p99_ms"], "added_p99_target_ms": ADDED_P99_TARGET_MS,
            "added_p99_ok": s["broker_added_p99_ms"] <= ADDED_P99_TARGET_MS}


class OtlpSink:
    """An OTLP/HTTP receiver in this process that accepts every export and only counts it (`--tracing`)."""

    def __init__(self) -> None:
        self.exports = {"traces": 0, "metrics": 0}
        self.bytes = 0
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def __aenter__(self) -> OtlpSink:
        app = web.Application()
        for kind in self.exports:
            app.router.add_post(f"/v1/{kind}", self._counter(kind))
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def _counter(self, kind: str) -> Callable[[web.Request], Any]:
        async def receive(request: web.Request) -> web.Response:
            self.bytes += len(await request.read())
            self.exports[kind] += 1
            return web.Response(content_type="application/x-protobuf")
        return receive


def traced_config(upstream: str, sink_url: str) -> dict[str, Any]:
    """The passthrough broker with telemetry on, exporting to `sink_url` (metrics every 5 s)."""
    return {**passthrough_config(upstream),
            "telemetry": {"enabled": True, "endpoint": sink_url, "metrics_interval_s": 5.0}}


async def run(plan: Plan, *, tracing: bool = False, old_checkout: Path | None = None,
              lone: bool = False) -> dict[str, Any]:
    """Start the simulator, the proxy and the broker (and a traced broker, another checkout's broker); run both
    parts; return the results."""
    started, probe = time.perf_counter(), cpu_probe_ms()
    extra = (*((TRACED,) if tracing else ()), *((OLD,) if old_checkout else ()), *((LONE,) if lone else ()))
    names = (*TARGETS, *extra)
    async with OtlpSink() as sink, processes_together(start_simulator("--latency-base-ms", "0")) as (sim,):
        upstream = sim_base_url(sim)
        brokers = [start_broker(passthrough_config(upstream))]
        if tracing:
            brokers.append(start_broker(traced_config(upstream, sink.url)))
        if old_checkout is not None:
            brokers.append(start_broker(passthrough_config(upstream), pythonpath=old_checkout_path(old_checkout)))
        if lone:
            brokers.append(start_broker({"providers": [{"name": "sim", "base_url": upstream}]}))
        async with processes_together(start_proxy(upstream), *brokers) as (proxy, broker, *others):
            targets = [Target("direct", upstream.removesuffix("/v1"), sim), Target("proxy", proxy.url, proxy),
                       Target("broker", broker.url, broker), *(Target(n, o.url, o) for n, o in zip(extra, others))]
            rows = []
            for round_no in range(plan.rounds):
                for level, (concurrency, requests) in enumerate(zip(plan.concurrencies, plan.requests)):
                    for target in rotated(targets, round_no + level):
                        rows.append(await closed_run(target, sim, concurrency, requests, plan.warmup, round_no,
                                                     lone=lone))
            summary = {str(c): summarize_concurrency(rows, c, names) for c in plan.concurrencies}
            loaded = await equal_load(rotated(targets, plan.rounds), plan.open_rate, plan.open_s, lone=lone)
    return {"plan": asdict(plan), "names": list(names), "runs": rows, "summary": summary, "equal_load": loaded,
            "targets": {**verdict(summary), "equal_load_added_p99_ms": loaded["broker_added_p99_ms"]},
            "otlp_sink": {"exports": sink.exports, "bytes": sink.bytes} if tracing else None,
            "meta": run_meta(started, probe)}


def report(result: dict[str, Any]) -> str:
    """The printed tables."""
    names = result.get("names", TARGETS)
    per_target = [{"conc": s["concurrency"], "target": name, **{k: s[name][k] for k in
                   ("rps", "p50_ms", "p99_ms", "cpu_ms_per_req", "errors")}}
                  for s in result["summary"].values() for name in names]
    ratios = [{"conc": s["concurrency"], **{k: s[k] for k in
               ("broker_vs_proxy_rps", "broker_vs_direct_rps", "proxy_vs_direct_rps", "broker_added_p50_ms",
                "broker_added_p99_ms", "proxy_added_p99_ms", "broker_vs_proxy_cpu")}}
              for s in result["summary"].values()]
    eq = result["equal_load"]
    equal = [{"target": name, **{k: eq[name][k] for k in ("achieved_rps", "p50_ms", "p99_ms", "cpu_ms_per_req")},
              "added_p99_ms": eq.get(f"{name}_added_p99_ms")} for name in names]
    t = result["targets"]
    lines = ["Closed loop, medians over rounds (cpu = the target's own process; direct: the simulator's)",
             format_table(per_target, ["conc", "target", "rps", "p50_ms", "p99_ms", "cpu_ms_per_req", "errors"]),
             "", "Paired ratios and added latency (medians of per-round values)",
             format_table(ratios, list(ratios[0])),
             "", f"Equal load: Poisson {eq['rate']:g} req/s for {eq['duration_s']:g} s to each target",
             format_table(equal, list(equal[0])),
             "", f"Targets at concurrency {t['concurrency']}: throughput broker/proxy {t['throughput_ratio']:.2f} "
                 f"(>= {t['throughput_ratio_target']}: {'PASS' if t['throughput_ok'] else 'FAIL'}); "
                 f"added p99 {t['added_p99_ms']:.2f} ms (<= {t['added_p99_target_ms']:g} ms: "
                 f"{'PASS' if t['added_p99_ok'] else 'FAIL'}); added p99 at equal load "
                 f"{t['equal_load_added_p99_ms']:.2f} ms",
             "Hot-path targets: throughput broker/proxy " + " / ".join(
                 f"{r:.2f}" for r in t["floor_ratios"].values()) + f" at concurrency {' / '.join(t['floor_ratios'])} "
                 f"(>= {t['floor_ratio_target']} at each: {'PASS' if t['floor_ok'] else 'FAIL'}); p50 over the proxy's "
                 f"at concurrency {t['p50_over_proxy_concurrency']} {t['p50_over_proxy_ms']:+.2f} ms "
                 f"(<= +{t['p50_over_proxy_target_ms']:g} ms: {'PASS' if t['p50_over_proxy_ok'] else 'FAIL'})"]
    if OLD in names:
        old = [{"conc": s["concurrency"], **{k: s[k] for k in ("old_vs_proxy_rps", "broker_vs_proxy_rps",
                                                                "broker_vs_old_rps", "broker_vs_old_cpu",
                                                                "old_over_proxy_p50_ms",
                                                                "broker_over_proxy_p50_ms")}}
               for s in result["summary"].values()]
        lines += ["", "This checkout against the old one (broker_old), side by side (paired medians)",
                  format_table(old, list(old[0]))]
    if LONE in names:
        lone = [{"conc": s["concurrency"], **{k: s[k] for k in ("lone_vs_broker_rps", "lone_added_p50_ms",
                                                                 "lone_vs_broker_cpu")}}
                for s in result["summary"].values()]
        lines += ["", f"Lone requests at the defaults (broker_defaults) against passthrough (broker); target "
                      f"throughput >= {LONE_RATIO_TARGET}x (paired medians)", format_table(lone, list(lone[0]))]
    if TRACED in names:
        traced = [{"conc": s["concurrency"], **{k: s[k] for k in ("traced_vs_broker_rps", "traced_added_p50_ms",
                                                                   "traced_added_p99_ms", "traced_added_cpu_ms")}}
                  for s in result["summary"].values()]
        lines += ["", "Telemetry on vs off (broker_traced against broker; paired medians)",
                  format_table(traced, list(traced[0])),
                  f"OTLP sink received {result['otlp_sink']['exports']} ({result['otlp_sink']['bytes']} bytes)"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print its tables and write its JSON."""
    parser = argparse.ArgumentParser(prog="python -m bench.passthrough", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny run (seconds), for the smoke test")
    parser.add_argument("--rounds", type=int, help="override the number of interleaved rounds")
    parser.add_argument("--open-rate", type=float, help="req/s offered to each target in the equal-load part")
    parser.add_argument("--tracing", action="store_true",
                        help="also run a broker with telemetry on (OTLP to an in-process sink), beside off")
    parser.add_argument("--old-checkout", type=Path, help="also run that checkout's broker (e.g. a git worktree of "
                        "an older commit) side by side, as the baseline")
    parser.add_argument("--lone", action="store_true", help="also run a broker at its defaults (merging, cache, "
                        "tiers) on requests that cannot merge, against passthrough")
    parser.add_argument("--out", default=None, help="JSON output file")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.rounds or args.open_rate:
        plan = Plan(plan.concurrencies, plan.requests, plan.warmup, args.rounds or plan.rounds,
                    args.open_rate or plan.open_rate, plan.open_s)
    result = asyncio.run(run(plan, tracing=args.tracing, old_checkout=args.old_checkout, lone=args.lone))
    default_out = "passthrough_tracing.json" if args.tracing else "passthrough.json"
    publish(result, report(result), args.out or str(results_path(default_out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
