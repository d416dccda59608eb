"""The passthrough part of the benchmark report (issue: foundation), from `bench/results/passthrough.json`."""

from __future__ import annotations

from typing import Any

from bench.markdown import num, run_line, table, target_row
from bench.passthrough import ADDED_P99_TARGET_MS, TARGETS, THROUGHPUT_RATIO_TARGET

ISSUE = "foundation"
LABELS = {"direct": "simulator direct", "proxy": "minimal proxy", "broker": "mergebroker"}


def smoke(result: dict[str, Any]) -> bool:
    """Whether the result comes from a smoke-sized (`--quick`) run."""
    return max(result["plan"]["requests"]) < 100


def _level(result: dict[str, Any]) -> dict[str, Any]:
    """The summary at the concurrency the targets are judged at."""
    return result["summary"][str(result["targets"]["concurrency"])]


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's two targets at concurrency 16."""
    t = result["targets"]
    # Issue 12 asks the same throughput ratio at every concurrency run (1, 16 and 64).
    every_level = [target_row("12", f"broker throughput / minimal proxy's, concurrency {s['concurrency']}",
                              s["broker_vs_proxy_rps"], ">=", THROUGHPUT_RATIO_TARGET)
                   for s in result["summary"].values()]
    return [target_row(ISSUE, f"broker throughput / minimal proxy's, concurrency {t['concurrency']}",
                       t["throughput_ratio"], ">=", THROUGHPUT_RATIO_TARGET),
            target_row(ISSUE, f"p99 added vs. direct (ms), concurrency {t['concurrency']}", t["added_p99_ms"], "<=",
                       ADDED_P99_TARGET_MS), *every_level]


def findings(result: dict[str, Any]) -> list[str]:
    """Throughput and latency against the proxy and the direct path, in numbers; why a target was missed."""
    t, s, eq = result["targets"], _level(result), result["equal_load"]
    broker, proxy, direct = s["broker"], s["proxy"], s["direct"]
    out = [f"- Passthrough, concurrency {t['concurrency']}: the broker serves {num(broker['rps'], 0)} req/s, "
           f"{num(t['throughput_ratio'], 2)}x the minimal proxy's {num(proxy['rps'], 0)} req/s (goal >= "
           f"{THROUGHPUT_RATIO_TARGET:g}x); it spends {num(broker['cpu_ms_per_req'], 2)} ms of CPU per request vs. the "
           f"proxy's {num(proxy['cpu_ms_per_req'], 2)} ms. p99 {num(broker['p99_ms'], 1)} ms vs. "
           f"{num(direct['p99_ms'], 1)} ms direct: {num(t['added_p99_ms'], 1)} ms added (goal <= "
           f"{ADDED_P99_TARGET_MS:g} ms; the proxy adds {num(s['proxy_added_p99_ms'], 1)} ms).",
           f"- Passthrough at equal load ({eq['rate']:g} req/s Poisson, below every target's saturation): the broker "
           f"adds {num(eq['broker_added_p50_ms'], 1)} ms at p50 and {num(eq['broker_added_p99_ms'], 1)} ms at p99 "
           f"over direct; the proxy adds {num(eq['proxy_added_p50_ms'], 1)} and {num(eq['proxy_added_p99_ms'], 1)} ms."]
    if not t["added_p99_ok"]:
        out.append(
            f"- Why the p99 goal is missed: in the closed loop every target runs at its own saturation, so by "
            f"Little's law latency follows throughput: {t['concurrency']} requests in flight at "
            f"{num(broker['rps'], 0)} req/s is {num(1000 * t['concurrency'] / broker['rps'], 1)} ms each on "
            f"average, at the simulator's {num(direct['rps'], 0)} req/s "
            f"{num(1000 * t['concurrency'] / direct['rps'], 1)} ms; even the minimal proxy adds "
            f"{num(s['proxy_added_p99_ms'], 1)} ms there. Below saturation (equal load) the broker adds "
            f"{num(eq['broker_added_p99_ms'], 1)} ms at p99, the proxy {num(eq['proxy_added_p99_ms'], 1)} ms. Both "
            f"gaps come from CPU per request on CPUs shared with the simulator and the load generator: "
            f"{num(broker['cpu_ms_per_req'], 2)} ms for the broker vs. {num(proxy['cpu_ms_per_req'], 2)} ms for the "
            f"proxy ({num(s['broker_vs_proxy_cpu'], 1)}x), so only less broker CPU per request closes them.")
    return out


def sections(result: dict[str, Any], images: dict[str, str]) -> list[str]:
    """Closed-loop figures per target and concurrency, paired ratios, and the equal-load run."""
    plan, eq = result["plan"], result["equal_load"]
    levels = list(result["summary"].values())
    per_target = [[s["concurrency"], LABELS[name], num(s[name]["rps"], 0), num(s[name]["p50_ms"], 2),
                   num(s[name]["p99_ms"], 2), num(s[name]["cpu_ms_per_req"], 3), s[name]["errors"]]
                  for s in levels for name in TARGETS]
    ratios = [[s["concurrency"], num(s["broker_vs_proxy_rps"], 2), num(s["broker_vs_direct_rps"], 2),
               num(s["proxy_vs_direct_rps"], 2), num(s["broker_vs_proxy_cpu"], 2), num(s["broker_added_p50_ms"], 2),
               num(s["broker_added_p99_ms"], 2), num(s["proxy_added_p99_ms"], 2)] for s in levels]
    equal = [[LABELS[name], eq[name]["requests"], num(eq[name]["achieved_rps"], 0), num(eq[name]["p50_ms"], 2),
              num(eq[name]["p99_ms"], 2), num(eq[name]["cpu_ms_per_req"], 3),
              "" if name == "direct" else num(eq[f"{name}_added_p99_ms"], 2)] for name in TARGETS]
    requests = ", ".join(f"{r:,} at {c}" for c, r in zip(plan["concurrencies"], plan["requests"]))
    return [
        "## Passthrough overhead (issue: foundation)", "",
        "Three targets side by side in one run, upstream latency 0: the simulator directly, a minimal aiohttp "
        "reverse proxy (`bench/proxy_baseline.py`), and mergebroker with merging and caching off (distinct "
        f"prompts, so nothing coalesces). Closed loop, {plan['rounds']} round{'s' if plan['rounds'] != 1 else ''} "
        "whose target order rotates; per run "
        f"{requests} concurrent clients after {plan['warmup']} warm-up requests. Figures are medians over rounds, "
        "ratios medians of per-round (paired) ratios. CPU is the target process's scheduler run time "
        "(for 'direct', the simulator's).", "",
        run_line(result.get("meta"), "passthrough benchmark"), "",
        table(["clients", "target", "req/s", "p50 ms", "p99 ms", "CPU ms / req", "errors"], per_target), "",
        table(["clients", "broker / proxy req/s", "broker / direct req/s", "proxy / direct req/s",
               "broker / proxy CPU", "broker added p50 ms", "broker added p99 ms", "proxy added p99 ms"], ratios), "",
        f"Equal load: the same Poisson arrivals, {eq['rate']:g} req/s for {eq['duration_s']:g} s, offered to each "
        "target (below saturation, so latency shows the work added per request rather than queueing).", "",
        table(["target", "requests", "achieved req/s", "p50 ms", "p99 ms", "CPU ms / req", "added p99 ms"], equal),
        "",
    ]


def figures(result: dict[str, Any]) -> dict[str, Any]:
    """No charts: the tables carry it."""
    return {}
