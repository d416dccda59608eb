"""The cluster-mode part of the benchmark report, from `bench/results/cluster.json` (issue 13).

Savings are measured against the passthrough run (every request sent alone): calls saved = 1 - calls
per request / passthrough's, the same for prompt tokens. The cluster's share is its savings over the
single replica's. The hop is what cluster mode adds to a request, measured at the front-ends: the round
trip through Redis minus the worker's own time (`mergebroker_cluster_hop_seconds`).
"""

from __future__ import annotations

import statistics
from typing import Any

from bench.markdown import num, pct, run_line, table, target_row

ISSUE = "13 cluster"
PASSTHROUGH = "passthrough, 1 replica"
SINGLE = "1 replica (in-process)"
CLUSTER = "cluster: 2 front-ends + 2 workers"
KILL = "cluster, kill -9 of 1 of 2 workers"


def smoke(result: dict[str, Any]) -> bool:
    """Whether the result comes from a smoke-sized (`--quick`) run."""
    return result["plan"]["duration_s"] < 5


def savings(result: dict[str, Any], name: str, key: str) -> float:
    """The share of `key` (calls or prompt tokens per request) a run saved against the passthrough run."""
    base = result["runs"][PASSTHROUGH][key]
    return 1 - result["runs"][name][key] / base if base else 0.0


def kept(result: dict[str, Any], name: str, key: str) -> float:
    """A run's savings as a share of the single replica's."""
    single = savings(result, SINGLE, key)
    return savings(result, name, key) / single if single else 0.0


ORPHANS_S = 2.0  # issue 26: a dead worker's jobs answered within 2 s at the default settings


def _orphan_rows(result: dict[str, Any], kill: dict[str, Any]) -> list[dict[str, Any]]:
    """Orphans answered within 2 s plus one upstream call (issue 26; claim_idle_ms in results run with a shorter
    one): measured as the latest orphan's answer after the kill less the call that answered it (older results
    only have the whole time)."""
    net = kill.get("orphans_answered_after_kill_less_call_s")
    if net is not None:
        limit = min(ORPHANS_S, result["cluster"].get("claim_idle_ms", 5000) / 1000)
        return [target_row(ISSUE, "kill -9: orphans answered after the kill, less their own upstream call (s)", net,
                           "<=", limit)]
    return [target_row(ISSUE, "kill -9: orphans answered after the kill (s; claim_idle_ms + window + call)",
                       kill["orphans_answered_after_kill_s"], "<=", round(orphan_limit_s(result), 2))]


def orphan_limit_s(result: dict[str, Any]) -> float:
    """claim_idle_ms (2 s at the defaults, where presence finds a dead worker) plus one merge window and
    upstream call (the cluster run's p99 latency)."""
    idle_s = min(ORPHANS_S, result["cluster"].get("claim_idle_ms", 5000) / 1000)
    return idle_s + result["runs"][CLUSTER]["p99_ms"] / 1000


def added(result: dict[str, Any], quantile: str) -> float:
    """What the cluster adds to a latency quantile over in-process merging: the median over the side-by-side
    pairs when the run has several (one pair is noisy: a p99 rests on a handful of merged calls)."""
    pairs = result.get("latency_pairs")
    if pairs:
        return statistics.median(p[f"added_{quantile}_ms"] for p in pairs)
    runs = result["runs"]
    return runs[CLUSTER][f"{quantile}_ms"] - runs[SINGLE][f"{quantile}_ms"]


def _pairs_note(result: dict[str, Any]) -> str:
    pairs = result.get("latency_pairs") or []
    return f"; median of {len(pairs)} pairs" if len(pairs) > 1 else ""


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Savings kept, latency added, and nothing lost when a worker dies."""
    runs = result["runs"]
    cluster, kill = runs[CLUSTER], runs[KILL]
    return [
        target_row(ISSUE, "cluster: share of the single replica's call savings kept", kept(result, CLUSTER,
                                                                                           "calls_per_request"),
                   ">=", 0.9),
        target_row(ISSUE, "cluster: share of the single replica's token savings kept",
                   kept(result, CLUSTER, "prompt_tokens_per_request"), ">=", 0.9),
        target_row(ISSUE, "cluster hop at the front-ends, p50 (ms)", cluster["hop_p50_ms"], "<=", 2.0),
        target_row(ISSUE, "cluster hop at the front-ends, p99 (ms)", cluster["hop_p99_ms"], "<=", 10.0),
        target_row(ISSUE, f"cluster p50 minus in-process p50, end to end (ms{_pairs_note(result)})",
                   added(result, "p50"), "<=", 2.0),
        target_row(ISSUE, f"cluster p99 minus in-process p99, end to end (ms{_pairs_note(result)})",
                   added(result, "p99"), "<=", 10.0),
        target_row(ISSUE, "kill -9 of 1 of 2 workers: requests lost (non-200)", kill["errors"], "==", 0),
        target_row(ISSUE, "kill -9 of 1 of 2 workers: wrong answers", kill["wrong_answers"], "==", 0),
        *_orphan_rows(result, kill),
    ]


def findings(result: dict[str, Any]) -> list[str]:
    """What scaling out costs per replica, what the cluster keeps, and what a dead worker costs."""
    runs = result["runs"]
    per_replica = ", ".join(f"{name.split(' (')[0]} {pct(kept(result, name, 'calls_per_request'))}"
                            for name in runs if "per-replica" in name)
    cluster, kill = runs[CLUSTER], runs[KILL]
    return [
        f"- Cluster mode (issue 13): at {result['plan']['rate']:g} req/s on the batch tier, one replica saves "
        f"{pct(savings(result, SINGLE, 'calls_per_request'))} of upstream calls and "
        f"{pct(savings(result, SINGLE, 'prompt_tokens_per_request'))} of prompt tokens; per-replica mode keeps "
        f"{per_replica} of the call savings; 2 front-ends + 2 workers keep "
        f"{pct(kept(result, CLUSTER, 'calls_per_request'))} of the call and "
        f"{pct(kept(result, CLUSTER, 'prompt_tokens_per_request'))} of the token savings. The hop through Redis "
        f"measured at the front-ends: p50 {num(cluster['hop_p50_ms'], 1)} ms, p99 {num(cluster['hop_p99_ms'], 1)} ms "
        f"(end to end, p50 {num(cluster['p50_ms'] - runs[SINGLE]['p50_ms'], 0)} ms and p99 "
        f"{num(cluster['p99_ms'] - runs[SINGLE]['p99_ms'], 0)} ms against the single replica, whose one process "
        "serves every request).",
        *_why_latency(result),
        f"- Cluster mode, kill -9 of one of two workers halfway (the one holding more jobs: "
        f"{kill.get('killed_worker_held', 0)}): {kill['errors']} requests lost, "
        f"{kill['wrong_answers']} wrong answers, {kill['claims']:g} jobs claimed by the survivor, the last "
        f"orphan answered {num(kill['orphans_answered_after_kill_s'], 2)} s after the kill"
        + (f", {num(kill['orphans_answered_after_kill_less_call_s'], 2)} s less its own upstream call"
           if kill.get("orphans_answered_after_kill_less_call_s") is not None else "") + " (claim_idle_ms "
        f"{result['cluster'].get('claim_idle_ms', 'default')} ms), {kill['duplicates_dropped']:g} late duplicate "
        "replies dropped.",
    ]


def _why_latency(result: dict[str, Any]) -> list[str]:
    """When the hop misses its goal: the mechanism alone, against the same hop among six processes."""
    cluster, single, floor = result["runs"][CLUSTER], result["runs"][SINGLE], result.get("hop_floor") or {}
    if (cluster["hop_p50_ms"] or 0) <= 2 and (cluster["hop_p99_ms"] or 0) <= 10 or "p50_ms" not in floor:
        return []
    return [f"- Why the cluster's latency goals are missed: the hop alone (front-end queue and worker consumer in one "
            f"process, no HTTP) is p50 {num(floor['p50_ms'], 2)} ms and p99 {num(floor['p99_ms'], 2)} ms on this host; "
            f"in the benchmark the same hop crosses six processes (2 front-ends, 2 workers, Redis, the simulator) "
            f"sharing {result['meta']['cpus'] if result.get('meta') else 2} cores with the load generator, and "
            f"the deployment spends {num(cluster.get('broker_cpu_ms_per_request'), 2)} ms of CPU per request against "
            f"{num(single.get('broker_cpu_ms_per_request'), 2)} ms in one process: its round trips through Redis "
            "wait their turn for a core (the single replica has none to wait for)."]


def sections(result: dict[str, Any], images: dict[str, str]) -> list[str]:
    """One row per configuration, side by side."""
    rows = []
    for name, r in result["runs"].items():
        calls_saved = savings(result, name, "calls_per_request")
        tokens_saved = savings(result, name, "prompt_tokens_per_request")
        rows.append([name, r["requests"], r["errors"], r["wrong_answers"], num(r["calls_per_request"], 3),
                     pct(calls_saved), num(r["prompt_tokens_per_request"], 0), pct(tokens_saved),
                     num(r["p50_ms"], 0), num(r["p99_ms"], 0), num(r["hop_p50_ms"], 1), num(r["hop_p99_ms"], 1),
                     f"{r['claims']:g}"])
    c = result["cluster"]
    floor = result.get("hop_floor")
    floor_line = (f"The hop alone (a front-end queue and a worker consumer in one process, no HTTP, no upstream, jobs "
                  f"answered as soon as they are read, Poisson {floor['rate']:g} jobs/s): p50 {num(floor['p50_ms'], 2)} "
                  f"ms, p90 {num(floor['p90_ms'], 2)} ms, p99 {num(floor['p99_ms'], 2)} ms over {floor['jobs']} jobs."
                  if floor and "p50_ms" in floor else "")
    return [
        "## Cluster mode (issue 13)", "",
        f"The merge benchmark's mixed workload on the {result['tier']} tier, Poisson {result['plan']['rate']:g} req/s "
        f"for {result['plan']['duration_s']:g} s per configuration (the same arrivals in each), round-robin over the "
        "front-ends (replicas), every process real and sharing one Redis (flushed between runs), against the "
        f"simulator ({' '.join(result['simulator_options'])}). Cluster settings: {c['partitions']} partitions, "
        f"claim_idle_ms {c.get('claim_idle_ms', 'default')}, lease_ms {c.get('lease_ms', 'default')}. Savings are "
        "against the passthrough run "
        "(no merging, no cache). The hop is the front-ends' round trip through Redis minus the worker's own time. "
        "Every process shares the machine's 2 cores (with other work on the host): the cluster runs six processes "
        "where the single replica runs one, so its end-to-end latency differences carry that contention.", "",
        run_line(result.get("meta"), "cluster benchmark"), "",
        table(["configuration", "requests", "errors", "wrong", "calls/req", "calls saved", "prompt tok/req",
               "tokens saved", "p50 ms", "p99 ms", "hop p50 ms", "hop p99 ms", "claims"], rows), "",
        floor_line, "", *_pairs_table(result),
    ]


def _pairs_table(result: dict[str, Any]) -> list[str]:
    """The side-by-side latency pairs behind the added-latency targets."""
    pairs = result.get("latency_pairs") or []
    if len(pairs) < 2:
        return []
    rows = [[i + 1, num(p["single_p50_ms"], 1), num(p["cluster_p50_ms"], 1), num(p["added_p50_ms"], 1),
             num(p["single_p99_ms"], 1), num(p["cluster_p99_ms"], 1), num(p["added_p99_ms"], 1)]
            for i, p in enumerate(pairs)]
    return [f"Latency, in-process against cluster at equal load: {len(pairs)} pairs of runs, side by side (the first "
            "pair is the table above; later pairs alternate which runs first); the targets take the median "
            "difference.", "",
            table(["pair", "in-process p50", "cluster p50", "added p50", "in-process p99", "cluster p99",
                   "added p99"], rows), ""]


def figures(result: dict[str, Any]) -> dict[str, Any]:
    """No charts: the table carries it."""
    return {}
