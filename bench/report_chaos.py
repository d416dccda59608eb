"""The breakers-under-chaos part of the benchmark report, from `bench/results/chaos.json`.

The breakers issue names behaviours, not numbers, so the goals here come from the run's own breaker
settings and the degradation rule: an outage opens the breaker within its window; with every provider
open a caller is answered within milliseconds (< 50 ms); once the upstream is back the breaker closes by
its next probe (at most `open_max_s` after opening, plus 1 s for the probe and the /readyz poll); every
request gets exactly one answer or one error.
"""

from __future__ import annotations

from typing import Any

from bench.markdown import num, pct, run_line, secs, table, target_row

ISSUE = "breakers"
FAST_FAIL_P99_MS = 50.0
PROBE_SLACK_S = 1.0


def smoke(result: dict[str, Any]) -> bool:
    """Whether the result comes from a smoke-sized (`--quick`) run."""
    return sum(p["duration_s"] for p in result["plan"]["phases"]) < 10


def _phases(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["phase"]: p for p in result["phases"]}


def _unanswered(result: dict[str, Any]) -> int:
    a = result["accounting"]
    return int(a["missing"] + a["transport_errors"] + a["bad_bodies"])


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Opening, fast-failing, closing, and one answer per request."""
    breaker, outage = result["plan"]["breaker"], _phases(result)["outage"]
    return [target_row(ISSUE, "outage start -> first fast-fail (s; the breaker window)",
                       result["outage_to_first_fast_fail_s"], "<=", breaker["window_s"]),
            target_row(ISSUE, "outage: p99 latency of the answers (ms)", outage["p99_ms"], "<", FAST_FAIL_P99_MS),
            target_row(ISSUE, "recovery start -> breaker closed (s; open_max_s + 1 s)", result["recovery_to_closed_s"],
                       "<=", breaker["open_max_s"] + PROBE_SLACK_S),
            target_row(ISSUE, "requests without exactly one answer or one error", _unanswered(result), "==", 0)]


def findings(result: dict[str, Any]) -> list[str]:
    """Per phase, what callers saw and what the upstream was spared; the breaker's reaction times."""
    phases, a = _phases(result), result["accounting"]
    errors, outage, recovery = phases["errors_50"], phases["outage"], phases["recovery"]
    each = "every request got exactly one answer or one error" if a["exactly_one_each"] else \
        "NOT every request got exactly one answer or one error"
    return [
        f"- Chaos, 50 % upstream errors: {pct(errors['success_rate'])} of requests succeeded, "
        f"{errors['fast_fail']} of {errors['sent']} were fast-failed once the breaker opened, and the upstream saw "
        f"{errors['upstream_calls']} calls. Outage: {outage['fast_fail']} of {outage['sent']} fast-failed "
        f"(p99 {num(outage['p99_ms'], 1)} ms), {outage['upstream_calls']} upstream calls; the breaker was "
        f"{result['breaker_at_outage_start']} when the outage began and the first fast-fail came "
        f"{secs(result['outage_to_first_fast_fail_s'])} after it.",
        f"- Chaos, recovery: the breaker closed {secs(result['recovery_to_closed_s'])} after the upstream came back "
        f"(it was {result['breaker_at_recovery_start']}); {pct(recovery['success_rate'])} of the phase's requests "
        f"succeeded, {recovery['fast_fail']} were fast-failed before the probe closed it. Sent {a['sent']}, "
        f"answered {a['answered']}: {each}.",
    ]


def sections(result: dict[str, Any], images: dict[str, str]) -> list[str]:
    """Per-phase table, the breaker's timeline, and the accounting."""
    plan = result["plan"]
    rows = [[p["phase"], p["sent"], p["ok"], pct(p["success_rate"]), p["fast_fail"],
             ", ".join(f"{code} {n}" for code, n in p["errors_by_code"].items() if code != "upstream_unavailable")
             or "-", num(p["p50_ms"], 1), num(p["p99_ms"], 1), p["upstream_calls"]] for p in result["phases"]]
    timeline = ", ".join(f"{e['t_s']:.2f} s {e['state']}" for e in result["breaker_timeline"])
    lengths = ", ".join(f"{p['name']} {p['duration_s']:g} s" for p in plan["phases"])
    a = result["accounting"]
    return [
        "## Breakers under chaos (issue: breakers)", "",
        f"Poisson {plan['rate']:g} req/s through the broker (no merging, no cache) while the simulator goes "
        f"healthy -> 50 % errors -> down -> healthy ({lengths}), switched at run time. Provider breaker: "
        f"`{plan['breaker']}`. A fast-fail is a 503 with code `upstream_unavailable`; the breaker state is polled "
        f"from `/readyz` every {plan['poll_s'] * 1000:g} ms. Requests are counted in the phase they were sent in. "
        "The breakers issue names behaviours, not numbers, so the goals in the targets table come from the run's "
        "breaker settings and the degradation rule: the breaker opens within its window; with every provider open a "
        f"caller is answered within milliseconds (< {FAST_FAIL_P99_MS:g} ms); the breaker closes by its next probe "
        f"(at most `open_max_s` after opening, plus {PROBE_SLACK_S:g} s for the probe and the poll).", "",
        run_line(result.get("meta"), "chaos run"), "",
        table(["phase", "sent", "ok", "success", "fast-fails", "other errors", "p50 ms", "p99 ms", "upstream calls"],
              rows), "",
        f"Breaker states seen (seconds from the start): {timeline}. Outage start -> first fast-fail: "
        f"{secs(result['outage_to_first_fast_fail_s'])}; recovery start -> closed: "
        f"{secs(result['recovery_to_closed_s'])}. Sent {a['sent']}, answered {a['answered']}, transport errors "
        f"{a['transport_errors']}, bad bodies {a['bad_bodies']}, missing {a['missing']}.", "",
    ]


def figures(result: dict[str, Any]) -> dict[str, Any]:
    """No charts: the tables carry it."""
    return {}
