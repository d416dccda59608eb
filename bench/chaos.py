"""Chaos: steady traffic while the upstream goes healthy -> 50% errors -> total outage -> healthy.

Poisson traffic runs through the broker (no merging, no cache) for the whole run while the simulator's
faults are switched at run time (`POST /control/faults`). Breakers are set small so that each phase lasts
seconds. `/readyz` is polled throughout for the provider's breaker state. Reported per phase: success
rate, latency, fast-fails (503 `upstream_unavailable`), other errors by code, and upstream calls made;
overall: time from outage start to the first fast-fail, time from recovery to a closed breaker, and
whether every request sent got exactly one answer or one error.

    python -m bench.chaos [--quick] [--rate R] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from bench.harness import (
    Process,
    TimedSample,
    chat_request,
    cpu_probe_ms,
    format_table,
    get_json,
    latency_summary,
    open_loop,
    passthrough_config,
    processes_together,
    publish,
    results_path,
    run_meta,
    set_faults,
    sim_base_url,
    start_broker,
    start_simulator,
    warm_up,
)

FAST_FAIL_CODE = "upstream_unavailable"


@dataclass(frozen=True)
class Phase:
    """A named stretch of the run with the simulator faults it sets at its start."""

    name: str
    duration_s: float
    faults: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    """Phases, offered rate, /readyz poll interval and the provider's breaker settings."""

    phases: tuple[Phase, ...]
    rate: float
    poll_s: float
    breaker: dict[str, Any]


def phases(healthy_s: float, errors_s: float, outage_s: float, recovery_s: float) -> tuple[Phase, ...]:
    """healthy -> 50% errors -> down -> healthy, each phase setting every fault it relies on."""
    return (Phase("healthy", healthy_s, {"error_rate": 0.0, "down": False}),
            Phase("errors_50", errors_s, {"error_rate": 0.5, "down": False}),
            Phase("outage", outage_s, {"error_rate": 0.0, "down": True}),
            Phase("recovery", recovery_s, {"error_rate": 0.0, "down": False}))


FULL = Plan(phases(4.0, 5.0, 5.0, 8.0), rate=40.0, poll_s=0.05,
            breaker={"window_s": 5.0, "min_calls": 10, "open_s": 2.0, "open_max_s": 4.0})
QUICK = Plan(phases(0.4, 0.6, 0.6, 1.0), rate=40.0, poll_s=0.05,
             breaker={"window_s": 2.0, "min_calls": 5, "open_s": 0.5, "open_max_s": 0.5})


@dataclass
class Timeline:
    """What the run observed over time (perf_counter seconds): phase starts and breaker states."""

    current: str = "healthy"
    starts: list[tuple[str, float, int]] = field(default_factory=list)  # (phase, started_at, upstream calls so far)
    states: list[tuple[float, str]] = field(default_factory=list)  # (polled_at, breaker state) on each change
    switching: dict[str, float] = field(default_factory=dict)  # phase -> when its faults began to be set
    upstream_calls_end: int = 0


def chaos_body(run_id: str, timeline: Timeline) -> Callable[[int], tuple[dict[str, Any], dict[str, str], str]]:
    """Distinct prompts, each tagged with the phase current when it is sent."""
    def make(i: int) -> tuple[dict[str, Any], dict[str, str], str]:
        text = f"chaos {run_id} request {i}: what is the capital of region {i}?"
        return {"model": "sim-small", "messages": [{"role": "user", "content": text}]}, {}, timeline.current

    return make


async def drive_phases(sim: Process, plan: Plan, timeline: Timeline) -> None:
    """Switch the simulator's faults at each phase start; note upstream call counts at the boundaries."""
    for phase in plan.phases:
        timeline.switching[phase.name] = time.perf_counter()
        await set_faults(sim, **phase.faults)
        calls = (await get_json(sim.url + "/stats"))["chat_calls"]
        timeline.starts.append((phase.name, time.perf_counter(), calls))
        timeline.current = phase.name
        await asyncio.sleep(phase.duration_s)  # the phase's length is the experiment itself
    await set_faults(sim, error_rate=0.0, down=False)


async def poll_breaker(broker: Process, interval_s: float, stop: asyncio.Event, timeline: Timeline) -> None:
    """Record the provider's breaker state from /readyz whenever it changes, until `stop`."""
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            async with session.get(broker.url + "/readyz") as resp:
                body = await resp.json(content_type=None)
            state = body.get("providers", {}).get("sim", {}).get("state", "unknown")
            if not timeline.states or timeline.states[-1][1] != state:
                timeline.states.append((time.perf_counter(), state))
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except TimeoutError:
                pass


def state_at(timeline: Timeline, at: float) -> str:
    """The last breaker state polled at or before `at`."""
    seen = [state for t, state in timeline.states if t <= at]
    return seen[-1] if seen else "unknown"


def phase_report(name: str, samples: list[TimedSample], start: float, upstream_calls: int) -> dict[str, Any]:
    """Success rate, latency, fast-fails and error codes of the requests sent during one phase."""
    ok = [s for s in samples if s.status == 200 and s.error_code is None]
    fast = [s for s in samples if s.error_code == FAST_FAIL_CODE]
    codes = collections.Counter(s.error_code for s in samples if s.error_code is not None)
    return {"phase": name, "sent": len(samples), "ok": len(ok),
            "success_rate": len(ok) / len(samples) if samples else float("nan"),
            "fast_fail": len(fast), "errors_by_code": dict(codes), "upstream_calls": upstream_calls,
            "first_fast_fail_s": min((s.done_at - start for s in fast), default=None),
            **latency_summary([s.latency_s * 1000 for s in samples]),
            "ok_p99_ms": latency_summary([s.latency_s * 1000 for s in ok])["p99_ms"]}


def analyse(samples: list[TimedSample], sent: int, timeline: Timeline) -> dict[str, Any]:
    """Per-phase figures, the breaker's reaction times, and the one-answer-per-request check."""
    bounds = timeline.starts + [("end", float("inf"), timeline.upstream_calls_end)]
    per_phase = []
    for (name, start, calls), (following, _, next_calls) in zip(bounds, bounds[1:]):
        end = timeline.switching.get(following, float("inf"))
        mine = [s for s in samples if s.tag == name]
        report = phase_report(name, mine, start, next_calls - calls)
        # A request that outlived its phase may have met the next phase's upstream (on a loaded host, short
        # phases end while requests are still in flight): these are the failures that cannot be blamed on that.
        report["failed_within_phase"] = sum(1 for s in mine if s.done_at < end
                                            and not (s.status == 200 and s.error_code is None))
        per_phase.append(report)
    starts = {name: start for name, start, _ in timeline.starts}
    outage, recovery = starts["outage"], starts["recovery"]
    fast_after = [s.done_at - outage for s in samples if s.error_code == FAST_FAIL_CODE and s.done_at >= outage]
    closed_after = [t - recovery for t, state in timeline.states if t >= recovery and state == "closed"]
    transport = sum(1 for s in samples if s.status == 0)
    bad = sum(1 for s in samples if s.error_code == "bad_body")
    return {
        "phases": per_phase,
        "outage_to_first_fast_fail_s": min(fast_after, default=None),
        "breaker_at_outage_start": state_at(timeline, outage),
        "recovery_to_closed_s": min(closed_after, default=None),
        "breaker_at_recovery_start": state_at(timeline, recovery),
        "breaker_timeline": [{"t_s": round(t - timeline.starts[0][1], 3), "state": s} for t, s in timeline.states],
        "accounting": {"sent": sent, "answered": len(samples) - transport, "transport_errors": transport,
                       "bad_bodies": bad, "missing": sent - len(samples),
                       "exactly_one_each": sent == len(samples) and transport == 0 and bad == 0},
    }


async def run(plan: Plan) -> dict[str, Any]:
    """Start the simulator and the broker, run the phases under steady traffic, return the results."""
    started, probe = time.perf_counter(), cpu_probe_ms()
    async with processes_together(start_simulator()) as (sim,):
        config = passthrough_config(sim_base_url(sim), breaker=plan.breaker)
        async with processes_together(start_broker(config)) as (broker,):
            timeline = Timeline()
            await warm_up(broker.url, chaos_body("warm", timeline))
            stop = asyncio.Event()
            poller = asyncio.create_task(poll_breaker(broker, plan.poll_s, stop, timeline))
            send = chat_request(broker.url, chaos_body(uuid.uuid4().hex[:8], timeline), timeout_s=60.0, tolerant=True)
            total_s = sum(p.duration_s for p in plan.phases)
            load = open_loop(send, rate=plan.rate, duration_s=total_s)
            (samples, _), _ = await asyncio.gather(load, drive_phases(sim, plan, timeline))
            sent = len(samples)
            stop.set()
            await poller
            timeline.upstream_calls_end = (await get_json(sim.url + "/stats"))["chat_calls"]
    timed = [s for s in samples if isinstance(s, TimedSample)]
    return {"plan": asdict(plan), **analyse(timed, sent, timeline), "meta": run_meta(started, probe)}


def report(result: dict[str, Any]) -> str:
    """The printed tables."""
    cols = ["phase", "sent", "ok", "success_rate", "p50_ms", "p99_ms", "fast_fail", "first_fast_fail_s",
            "upstream_calls"]
    rows = [{k: p[k] for k in cols} for p in result["phases"]]
    codes = "; ".join(f"{p['phase']}: {p['errors_by_code'] or '-'}" for p in result["phases"])
    a = result["accounting"]
    timeline = " ".join(f"{e['t_s']:.2f}s:{e['state']}" for e in result["breaker_timeline"])

    def secs(value: float | None) -> str:
        return "never" if value is None else f"{value:.2f} s"

    return "\n".join([
        f"Poisson {result['plan']['rate']:g} req/s; breaker {result['plan']['breaker']}",
        format_table(rows, cols), "", f"Errors by code: {codes}",
        f"Breaker timeline: {timeline}",
        f"Outage start -> first fast-fail: {secs(result['outage_to_first_fast_fail_s'])} "
        f"(breaker was {result['breaker_at_outage_start']} at outage start)",
        f"Recovery start -> breaker closed: {secs(result['recovery_to_closed_s'])} "
        f"(breaker was {result['breaker_at_recovery_start']} at recovery start)",
        f"Sent {a['sent']}, answered {a['answered']}, transport errors {a['transport_errors']}, "
        f"bad bodies {a['bad_bodies']}, missing {a['missing']}: exactly one answer or error each: "
        f"{'PASS' if a['exactly_one_each'] else 'FAIL'}"])


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print its tables and write its JSON; exit 1 if a request went unanswered."""
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny run (seconds), for the smoke test")
    parser.add_argument("--rate", type=float, help="offered Poisson rate, req/s")
    parser.add_argument("--out", default=str(results_path("chaos.json")), help="JSON output file")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.rate:
        plan = Plan(plan.phases, args.rate, plan.poll_s, plan.breaker)
    result = asyncio.run(run(plan))
    publish(result, report(result), args.out)
    return 0 if result["accounting"]["exactly_one_each"] else 1


if __name__ == "__main__":
    sys.exit(main())
