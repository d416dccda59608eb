"""The tiers-and-queues part of the benchmark report, from `bench/results/tiers.json`."""

from __future__ import annotations

from typing import Any

from bench.markdown import num, ratio, run_line, table, target_row
from bench.tiers import NEAR_INTERVALS, QUEUE_OVERHEAD_TARGET_MS

ISSUE = "tiers and queues"
SATURATED = 0.9  # loaded throughput / limit at which the limiter counts as saturated (as bench.tiers judges it)


def smoke(result: dict[str, Any]) -> bool:
    """Whether the result comes from a smoke-sized (`--quick`) run."""
    return result["plan"]["phase_s"] < 5


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Realtime p99 near its baseline under a saturated limit, and the queue's CPU overhead."""
    t, loaded = result["targets"], result["loaded"]
    return [target_row(ISSUE, "load saturates the limit: loaded throughput / limit",
                       ratio(loaded["throughput_rps"], loaded["limit_rps"]), ">=", SATURATED),
            target_row(ISSUE, f"realtime p99, loaded minus unloaded (ms; {NEAR_INTERVALS} bucket intervals)",
                       t["realtime_p99_added_ms"], "<=", NEAR_INTERVALS * t["bucket_interval_ms"]),
            target_row(ISSUE, "queue overhead: broker CPU per request, limiter queue minus passthrough (ms)",
                       t["queue_overhead_cpu_ms_per_req"], "<", QUEUE_OVERHEAD_TARGET_MS)]


def findings(result: dict[str, Any]) -> list[str]:
    """Realtime vs. batch latency under the limit, and what the queue costs in CPU."""
    t, loaded, plain = result["targets"], result["loaded"], result["passthrough"]
    intervals = ratio(t["realtime_p99_added_ms"], t["bucket_interval_ms"])
    out = [f"- Tiers under a saturated limit ({result['plan']['rpm']} rpm, loaded throughput "
           f"{num(loaded['throughput_rps'], 2)} req/s for a limit of {num(loaded['limit_rps'], 1)}): realtime p99 "
           f"{num(t['realtime_p99_loaded_ms'], 0)} ms vs. {num(t['realtime_p99_unloaded_ms'], 0)} ms unloaded "
           f"(+{num(t['realtime_p99_added_ms'], 0)} ms, {num(intervals, 1)} bucket intervals of "
           f"{num(t['bucket_interval_ms'], 0)} ms); realtime p50 {num(t['realtime_p50_ms'], 0)} ms "
           f"while batch absorbs the wait (p50 {num(t['batch_p50_ms'], 0)} ms, p99 {num(t['batch_p99_ms'], 0)} ms).",
           f"- Queue overhead: {num(loaded['cpu_ms_per_req'], 3)} ms of broker CPU per request with the limiter "
           f"queueing vs. {num(plain['cpu_ms_per_req'], 3)} ms through a broker without a limit at the same rate and "
           f"tier mix: {num(t['queue_overhead_cpu_ms_per_req'], 3)} ms (goal < {QUEUE_OVERHEAD_TARGET_MS:g} ms)."]
    if not t["queue_overhead_ok"]:
        out.append(_overhead_note(result))
    return out


def _overhead_note(result: dict[str, Any]) -> str:
    """Why the queue overhead missed its goal, in this run's numbers."""
    loaded, plain, idle = result["loaded"], result["passthrough"], result.get("idle_cpu_ms_per_s")
    text = (f"- Why the queue-overhead goal is missed: the limiter queue adds "
            f"{num(result['targets']['queue_overhead_cpu_ms_per_req'], 2)} ms to {num(plain['cpu_ms_per_req'], 2)} ms "
            "of CPU per request")
    if idle:
        text += (f"; idle, the two brokers spend {num(idle['limited'], 1)} and {num(idle['plain'], 1)} ms of CPU per "
                 "second, so the difference is work done per request")
    return (text + f". The limited broker holds {result['plan']['batch_concurrency']} batch requests open for "
            f"{num(loaded['batch']['mean_ms'] / 1000, 1)} s each on average (connections, deadlines, limiter "
            f"wake-ups), where the broker without a limit answers them in {num(plain['batch']['mean_ms'], 0)} ms; "
            "profiling a broker with an `rpm` provider under this load would show which part is the queue's own.")


def sections(result: dict[str, Any], images: dict[str, str]) -> list[str]:
    """Latency per phase and tier, and broker CPU per request with and without the queue."""
    plan, loaded, plain = result["plan"], result["loaded"], result["passthrough"]
    cols = ("requests", "ok", "p50_ms", "p90_ms", "p99_ms", "max_ms")

    def row(phase: str, tier: str, stats: dict[str, Any]) -> list[Any]:
        return [phase, tier, *(stats[c] if c in ("requests", "ok") else num(stats[c], 1) for c in cols)]

    rows = [row("unloaded", "realtime", result["unloaded"]["realtime"]),
            row("loaded (limit saturated)", "realtime", loaded["realtime"]),
            row("loaded (limit saturated)", "batch", loaded["batch"]),
            row("no limit, same rate", "realtime", plain["realtime"]),
            row("no limit, same rate", "batch", plain["batch"])]
    idle = result.get("idle_cpu_ms_per_s") or {}
    cpu = [["with the limiter queue", int(loaded["realtime"]["requests"] + loaded["batch"]["requests"]),
            num(loaded["cpu_ms_per_req"], 3), num(idle.get("limited"), 1)],
           ["no limit (passthrough)", plain["requests"], num(plain["cpu_ms_per_req"], 3), num(idle.get("plain"), 1)]]
    return [
        "## Tiers and queues (issue: tiers and queues)", "",
        f"One provider declared with `rpm: {plan['rpm']}` ({plan['rpm'] / 60:g} req/s), so the broker's upstream "
        f"limiter paces calls and queues the rest by tier priority; upstream latency {plan['upstream_latency_ms']:g} "
        f"ms. Unloaded: realtime alone, Poisson {plan['realtime_rate']:g} req/s for {plan['phase_s']:g} s. Loaded: "
        f"the same realtime stream while {plan['batch_concurrency']} batch clients keep requests waiting (closed "
        "loop). Meanwhile a second broker without `rpm` gets the same tier mix at the limit's rate, so CPU per "
        f"request with and without the queue is measured side by side. A realtime call still waits for the "
        f"bucket's next slot ({60_000 / plan['rpm']:g} ms apart) and behind realtime calls that came just before it, "
        f"so 'near its unloaded value' means within {NEAR_INTERVALS} intervals.", "",
        run_line(result.get("meta"), "tiers benchmark"), "",
        table(["phase", "tier", "requests", "ok", "p50 ms", "p90 ms", "p99 ms", "max ms"], rows), "",
        table(["broker", "requests", "CPU ms / request", "idle CPU ms / s (before the load)"], cpu), "",
    ]


def figures(result: dict[str, Any]) -> dict[str, Any]:
    """No charts: the tables carry it."""
    return {}
