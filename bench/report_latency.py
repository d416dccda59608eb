"""The latency part of the benchmark report (issue 12: adaptive windows, early release), from `latency.json`."""

from __future__ import annotations

from typing import Any

from bench.latency import ADDED_P50_TARGET_MS, EARLY_RELEASE_CUT_TARGET, SAVINGS_SHARE_TARGET, SEQUENTIAL
from bench.markdown import num, pct, run_line, table, target_row

ISSUE = "12"
LABELS = {"passthrough": "merging off (passthrough)", "adaptive": "default: adaptive windows",
          "fixed": "window_policy: fixed (before)"}


def smoke(result: dict[str, Any]) -> bool:
    """Whether the result comes from a smoke-sized (`--quick`) run."""
    return result["plan"]["sequential_requests"] < 100


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Sequential added p50, savings kept per workload, early release's cut of members' added latency."""
    out = []
    if "sequential" in result:
        out.append(target_row(ISSUE, "sequential client, default config: p50 added over passthrough (ms)",
                              result["sequential"]["summary"]["adaptive"]["added_p50_ms"], "<=", ADDED_P50_TARGET_MS))
    for name, part in result.get("savings", {}).items():
        out.append(target_row(ISSUE, f"{name}: adaptive windows' call savings / fixed windows'",
                              part["savings_kept"], ">=", SAVINGS_SHARE_TARGET))
    if "early_release" in result:
        out.append(target_row(ISSUE, "merged members' mean added latency over direct: cut by early release",
                              result["early_release"]["cut"], ">=", EARLY_RELEASE_CUT_TARGET))
    return out


def findings(result: dict[str, Any]) -> list[str]:
    """Old beside new for each target, in numbers."""
    out = []
    if "sequential" in result:
        s = result["sequential"]["summary"]
        out.append(f"- Sequential client on the default config: p50 {num(s['adaptive']['p50_ms'], 2)} ms with adaptive "
                   f"windows vs. {num(s['fixed']['p50_ms'], 2)} ms with fixed ones (passthrough "
                   f"{num(s['passthrough']['p50_ms'], 2)} ms): {num(s['adaptive']['added_p50_ms'], 2)} ms added instead "
                   f"of {num(s['fixed']['added_p50_ms'], 2)} ms; {num(s['adaptive']['rps'], 0)} req/s instead of "
                   f"{num(s['fixed']['rps'], 0)}.")
    for name, part in result.get("savings", {}).items():
        runs = part["runs"]
        out.append(f"- {name}: adaptive windows save {pct(part['savings']['adaptive'])} of upstream calls, fixed "
                   f"{pct(part['savings']['fixed'])} ({num(part['savings_kept'], 3)} of it kept); p50 "
                   f"{num(runs['adaptive']['p50_ms'], 0)} ms vs. {num(runs['fixed']['p50_ms'], 0)} ms.")
    if "early_release" in result:
        e = result["early_release"]
        out.append(f"- Early release: merged members' mean latency over direct {num(e['early']['added_ms'], 0)} ms vs. "
                   f"{num(e['whole']['added_ms'], 0)} ms when released on the whole reply "
                   f"({pct(e['cut'])} less; mean member latency {num(e['early']['mean_ms'], 0)} ms vs. "
                   f"{num(e['whole']['mean_ms'], 0)} ms, direct {num(e['direct_mean_ms'], 0)} ms).")
    if "merged_streams" in result:
        m = result["merged_streams"]
        by = m["broker_ttft_by_position"]
        out.append(f"- Merged streams (batches of {m['batch']}): time to first token grows with the position in the "
                   f"batch, {num(by['1']['mean_ms'], 0)} ms for the first member to {num(by[str(m['batch'])]['mean_ms'], 0)} "
                   f"ms for the last (client mean {num(m['client_ttft_ms']['merged']['mean'], 0)} ms vs. "
                   f"{num(m['client_ttft_ms']['direct']['mean'], 0)} ms direct): why `merge_streams` is on for "
                   f"batch only.")
    return out


def sections(result: dict[str, Any], images: dict[str, str]) -> list[str]:
    """The tables of each part."""
    out = ["## No waiting for nothing (issue 12)", "", run_line(result.get("meta"), "latency benchmark"), ""]
    if "sequential" in result:
        s, plan = result["sequential"]["summary"], result["plan"]
        rows = [[LABELS[n], num(s[n]["rps"], 0), num(s[n]["p50_ms"], 2), num(s[n]["p99_ms"], 2),
                 num(s[n].get("added_p50_ms"), 2) if n != "passthrough" else ""] for n in SEQUENTIAL]
        out += ["### Sequential client", "",
                f"One client, {plan['sequential_requests']} mergeable requests one after another per broker and round "
                f"({plan['rounds']} rounds, order rotated), upstream latency 0; three brokers side by side.", "",
                table(["broker", "req/s", "p50 ms", "p99 ms", "p50 added over passthrough (ms, paired)"], rows), ""]
    if result.get("savings"):
        rows = [[name, p, part["runs"][p]["requests"], part["runs"][p]["upstream_calls"], pct(part["savings"][p]),
                 num(part["runs"][p]["mean_batch_size"], 2), num(part["runs"][p]["p50_ms"], 0),
                 num(part["runs"][p]["p99_ms"], 0), part["runs"][p]["errors"] + part["runs"][p]["wrong_answers"]]
                for name, part in result["savings"].items() for p in ("fixed", "adaptive")]
        out += ["### Call savings, adaptive vs. fixed windows", "",
                "The workloads of the merge benchmark (simulator: 300 ms + 2 ms per token); savings = share of requests "
                "that cost no upstream call of their own.", "",
                table(["workload", "windows", "requests", "upstream calls", "savings", "mean batch", "p50 ms",
                       "p99 ms", "errors + wrong"], rows), ""]
    if "early_release" in result:
        e = result["early_release"]
        rows = [[mode, num(e[mode]["mean_ms"], 0), num(e[mode]["added_ms"], 0), num(e[mode]["p99_ms"], 0),
                 e[mode]["errors"]] for mode in ("whole", "early")]
        out += ["### Early release", "", e["description"], "",
                table(["release", "member mean ms", "mean added over direct (ms)", "member p99 ms", "errors"], rows),
                ""]
    if "merged_streams" in result:
        m = result["merged_streams"]
        rows = [[p, num(v["members"], 0), num(v["mean_ms"], 0)] for p, v in m["broker_ttft_by_position"].items()]
        client = m["client_ttft_ms"]
        out += ["### Merged streams: time to first token by position", "",
                f"Batches of {m['batch']} streaming requests sent together to a batch-tier broker (`merge_streams` "
                f"on, early release, same upstream as above) and to the simulator directly. The broker's "
                f"`mergebroker_merged_stream_ttft_seconds` by position; clients saw {num(client['merged']['mean'], 0)} "
                f"ms on average (p50 {num(client['merged']['p50'], 0)}) vs. {num(client['direct']['mean'], 0)} ms "
                f"direct (p50 {num(client['direct']['p50'], 0)}).", "",
                table(["position in batch", "members", "mean time to first token (ms, from the call's start)"], rows),
                ""]
    return out


def figures(result: dict[str, Any]) -> dict[str, Any]:
    """No charts: the tables carry it."""
    return {}
