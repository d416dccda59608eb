"""What the Responses and Messages APIs cost per request, against Chat Completions passthrough.

One broker (no merging, no cache) in front of one simulator, the load generator, the broker and the
simulator on the same cores. Four routes, each asked for the same kind of answer (a text reply to a
request carrying one tool the model is told not to call, so no route can be merged or cached):

- `chat`: `POST /v1/chat/completions`, relayed as is (the baseline);
- `responses_native`: `POST /v1/responses` to an upstream that speaks it (the body as sent);
- `responses_translated`: `POST /v1/responses` sent as Chat Completions and answered back (`responses: translate`);
- `messages_translated`: `POST /v1/messages` sent as Chat Completions and answered back.

Closed loop at concurrency 1 and 16, in rounds whose route order rotates so drift hits every route alike;
each figure is the median over rounds, each ratio the median of per-round (paired) ratios against `chat`:
the broker's CPU milliseconds per request, and the latency it adds. `--burn N` adds N CPU burner processes
(a busy host).

    python -m bench.inbound_apis [--quick] [--burn 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

from bench.bursts import start_burners, stop_burners
from bench.harness import (
    CpuWindow,
    Process,
    RequestFn,
    Sample,
    closed_loop,
    cpu_probe_ms,
    format_table,
    median_of_measured,
    processes_together,
    publish,
    results_path,
    run_meta,
    sim_base_url,
    start_broker,
    start_simulator,
    summarize,
)

ROUTES = ("chat", "responses_native", "responses_translated", "messages_translated")
_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@dataclass(frozen=True)
class Plan:
    concurrencies: tuple[int, ...]
    requests: tuple[int, ...]
    warmup: int
    rounds: int


FULL = Plan((1, 16), (300, 1200), warmup=50, rounds=3)
QUICK = Plan((1, 16), (6, 24), warmup=2, rounds=1)


def broker_config(upstream: str) -> dict[str, Any]:
    """Two providers on one simulator: `sim-small` native to /v1/responses, `sim-large` translated."""
    return {"providers": [{"name": "native", "base_url": upstream, "models": ["sim-small"], "responses": "native"},
                          {"name": "translated", "base_url": upstream, "models": ["sim-large"],
                           "responses": "translate"}],
            "merge": {"enabled": False}, "cache": {"enabled": False}}


def request_for(route: str, question: str) -> tuple[str, dict[str, Any]]:
    """The path and body of one request on `route`."""
    if route == "chat":
        return "/v1/chat/completions", {
            "model": "sim-small", "messages": [{"role": "user", "content": question}], "tool_choice": "none",
            "tools": [{"type": "function", "function": {"name": "weather", "parameters": _PARAMETERS}}]}
    if route.startswith("responses"):
        return "/v1/responses", {
            "model": "sim-small" if route == "responses_native" else "sim-large", "input": question, "store": False,
            "tool_choice": "none", "tools": [{"type": "function", "name": "weather", "parameters": _PARAMETERS}]}
    return "/v1/messages", {
        "model": "sim-large", "max_tokens": 256, "messages": [{"role": "user", "content": question}],
        "tool_choice": {"type": "none"}, "tools": [{"name": "weather", "input_schema": _PARAMETERS}]}


def sender(url: str, route: str, run_id: str) -> RequestFn:
    async def send(session: aiohttp.ClientSession, i: int) -> Sample:
        path, body = request_for(route, f"inbound {run_id} request {i}: what is {i} squared?")
        started = time.perf_counter()
        async with session.post(url + path, json=body) as resp:
            await resp.read()
            return Sample(time.perf_counter() - started, resp.status)

    return send


async def closed_run(broker: Process, sim: Process, route: str, concurrency: int, requests: int, warmup: int,
                     round_no: int) -> dict[str, Any]:
    send = sender(broker.url, route, uuid.uuid4().hex[:8])
    await closed_loop(send, concurrency=concurrency, total=warmup)
    own, upstream = CpuWindow(broker), CpuWindow(sim)
    samples, wall = await closed_loop(send, concurrency=concurrency, total=requests)
    return {"round": round_no, "concurrency": concurrency, "route": route, **summarize(samples, wall),
            "cpu_ms_per_req": own.ms_per(len(samples)), "sim_cpu_ms_per_req": upstream.ms_per(len(samples))}



def summarize_level(rows: list[dict[str, Any]], concurrency: int) -> dict[str, Any]:
    """Medians per route and paired figures against `chat` for one concurrency level."""
    by_round: dict[int, dict[str, dict[str, Any]]] = {}
    for r in rows:
        if r["concurrency"] == concurrency:
            by_round.setdefault(r["round"], {})[r["route"]] = r
    rounds = [t for t in by_round.values() if set(ROUTES) <= set(t)]
    out: dict[str, Any] = {"concurrency": concurrency, "rounds": len(rounds)}
    for route in ROUTES:
        out[route] = {k: median_of_measured([t[route][k] for t in rounds]) for k in ("rps", "p50_ms", "p99_ms", "cpu_ms_per_req")}
        out[route]["errors"] = sum(t[route]["requests"] - t[route]["ok"] for t in rounds)
        out[route]["cpu_vs_chat"] = median_of_measured([t[route]["cpu_ms_per_req"] / t["chat"]["cpu_ms_per_req"]
                                             for t in rounds if t["chat"]["cpu_ms_per_req"]])
        out[route]["added_p50_ms"] = median_of_measured([t[route]["p50_ms"] - t["chat"]["p50_ms"] for t in rounds])
    return out


async def run(plan: Plan, burners: int) -> dict[str, Any]:
    started, probe = time.perf_counter(), cpu_probe_ms()
    burning = start_burners(burners) if burners else []
    try:
        async with processes_together(start_simulator("--latency-base-ms", "0")) as (sim,):
            async with processes_together(start_broker(broker_config(sim_base_url(sim)))) as (broker,):
                rows = []
                for round_no in range(plan.rounds):
                    for level, (concurrency, requests) in enumerate(zip(plan.concurrencies, plan.requests)):
                        k = (round_no + level) % len(ROUTES)
                        for route in (*ROUTES[k:], *ROUTES[:k]):
                            rows.append(await closed_run(broker, sim, route, concurrency, requests, plan.warmup,
                                                         round_no))
    finally:
        stop_burners(burning)
    summary = {str(c): summarize_level(rows, c) for c in plan.concurrencies}
    return {"plan": asdict(plan), "burners": burners, "runs": rows, "summary": summary,
            "meta": run_meta(started, probe)}


def report(result: dict[str, Any]) -> str:
    rows = [{"conc": s["concurrency"], "route": route, **{k: s[route][k] for k in
             ("rps", "p50_ms", "p99_ms", "cpu_ms_per_req", "cpu_vs_chat", "added_p50_ms", "errors")}}
            for s in result["summary"].values() for route in ROUTES]
    return "\n".join([f"Per request against chat passthrough, medians over rounds ({result['burners']} CPU burners; "
                      "cpu = the broker's own process)",
                      format_table(rows, list(rows[0]))])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.inbound_apis", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny run (seconds), for the smoke test")
    parser.add_argument("--burn", type=int, default=0, help="CPU burner processes running alongside")
    parser.add_argument("--out", default=str(results_path("inbound_apis.json")), help="JSON output file")
    args = parser.parse_args(argv)
    result = asyncio.run(run(QUICK if args.quick else FULL, args.burn))
    publish(result, report(result), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
