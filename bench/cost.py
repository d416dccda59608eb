"""Merging that pays: the bill of a caching provider, sent direct and through the broker, side by side.

The upstream is `mergebroker simulate --billing openai`: it caches prompt prefixes as OpenAI does (1,024
tokens minimum, 128-token steps), reports `prompt_tokens_details.cached_tokens`, counts tokens its own way
(not the broker's tokenizer) and keeps a bill at the prices it is given. Each workload is 240 unique
questions in the batch tier at 40 req/s, so no cache or coalescing can help and only merging changes the
bill. Each arm starts on a cold provider cache (`POST /_sim/bill/reset`):

- direct: the requests go straight to the simulator (the bill a client pays without the broker);
- broker: the same requests, at the same times, through a broker priced like the simulator.

The upstream's tokenizer is not the broker's: each workload runs on upstreams that count 30% more and 30%
fewer tokens than o200k_base (`--token-scale`), as Anthropic's, Gemini's and open models' tokenizers do,
and on one that counts like it. The broker learns the scale from the calls it sends, merged or alone.

Reported per workload, token scale and price point: both bills and their ratio, upstream calls, wrong answers (an
answer that differs from the direct arm's answer to the same question), and the broker's own account:
`actual_usd` against the broker arm's bill, and `alone_usd` against the direct arm's bill.

`python -m bench.cost [--quick] [--scales 0.7,1.3]` writes `bench/results/cost.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from bench.harness import (
    Process,
    Sample,
    format_table,
    get_json,
    open_loop,
    post_json,
    publish,
    results_path,
    run_meta,
    start_broker,
    start_simulator,
)

MODEL = "bench-model"
PRICE_POINTS = {"4o-like": (2.50, 1.25, 10.0), "5-like": (1.25, 0.125, 10.0)}
RATE = 40.0
ANSWER_WORDS = 64  # about 85 tokens: the simulator's answers run to this many words
MAX_TOKENS = 200
_FILLER = ("policy", "account", "invoice", "device", "region", "backup", "schedule", "support", "limit", "plan",
           "customer", "release", "storage", "network", "report", "quota", "upgrade", "access", "history", "team")


@dataclass(frozen=True)
class Workload:
    """Unique questions, each with one of the workload's system prompts (or none)."""

    name: str
    system_words: int  # 0: no system prompt
    systems: int
    question_words: int

    def bodies(self, n: int, seed: int = 11) -> list[dict[str, Any]]:
        rng = random.Random(seed)
        systems = [_prose(self.system_words, random.Random(100 + s)) for s in range(self.systems)]
        bodies = []
        for i in range(n):
            question = f"Question {i}: " + _prose(self.question_words, rng) + "?"
            messages = ([{"role": "system", "content": systems[i % len(systems)]}] if self.system_words else [])
            bodies.append({"model": MODEL, "messages": [*messages, {"role": "user", "content": question}],
                           "max_tokens": MAX_TOKENS, "temperature": 0})
        return bodies


# Sizes in the simulator's own token count (about one token per word here), as the issue measured them.
WORKLOADS = (
    Workload("long (2 system prompts of ~2,400 tokens)", 2380, 2, 36),
    Workload("mid (1 system prompt of ~600 tokens)", 585, 1, 36),
    Workload("short (no system prompt, ~15-token questions)", 0, 1, 12),
)


def _prose(words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(_FILLER) for _ in range(words))


async def _send_all(url: str, bodies: list[dict[str, Any]], headers: dict[str, str]) -> list[str | None]:
    """Every body at RATE req/s (Poisson, seeded), each answer's text (None when it failed)."""
    texts: list[str | None] = [None] * len(bodies)

    async def send(session: aiohttp.ClientSession, i: int) -> Sample:
        started = time.perf_counter()
        async with session.post(url + "/v1/chat/completions", json=bodies[i], headers=headers) as resp:
            data = await resp.json(content_type=None)
            if resp.status == 200:
                texts[i] = data["choices"][0]["message"]["content"]
            return Sample(time.perf_counter() - started, resp.status)

    await open_loop(send, rate=RATE, total=len(bodies))
    return texts


async def _bill(sim: Process) -> dict[str, Any]:
    return await get_json(sim.url + "/_sim/bill")


async def run_point(sim: Process, workload: Workload, point: str, n: int, scale: float = 1.0) -> dict[str, Any]:
    """Both arms of one workload at one price point, on an upstream counting `scale` times o200k_base."""
    price_in, price_cached, price_out = PRICE_POINTS[point]
    await post_json(sim.url + "/control/faults", {"price_input": price_in, "price_cached_input": price_cached,
                                                  "price_output": price_out, "token_scale": scale})
    bodies = workload.bodies(n)
    await post_json(sim.url + "/_sim/bill/reset", {})
    direct_texts = await _send_all(sim.url, bodies, {"Authorization": "Bearer direct"})
    direct = await _bill(sim)
    await post_json(sim.url + "/_sim/bill/reset", {})
    config = {"providers": [{"name": "sim", "base_url": sim.url + "/v1", "models": [MODEL]}],
              "pricing": {MODEL: {"input": price_in, "cached_input": price_cached, "output": price_out}},
              "merge": {"embedder": "none"}}
    broker = await start_broker(config)
    try:
        broker_texts = await _send_all(broker.url, [{**b, "broker": {"tier": "batch"}} for b in bodies], {})
        stats = await get_json(broker.url + "/v1/broker/stats")
    finally:
        broker.stop()
    through = await _bill(sim)
    wrong = sum(1 for d, b in zip(direct_texts, broker_texts) if b is None or b != d)
    cost = stats.get("cost", {})
    return {"workload": workload.name, "token_scale": scale, "prices": point,
            "calibrated": cost.get("calibrated"), "direct_usd": direct["usd"], "broker_usd": through["usd"],
            "ratio": through["usd"] / direct["usd"] if direct["usd"] else float("nan"),
            "direct_calls": direct["requests"], "broker_calls": through["requests"],
            "direct_bill": direct, "broker_bill": through,
            "wrong": wrong, "actual_usd": cost.get("actual_usd"), "alone_usd": cost.get("alone_usd"),
            "actual_vs_bill": _off(cost.get("actual_usd"), through["usd"]),
            "alone_vs_direct": _off(cost.get("alone_usd"), direct["usd"])}


def _percent(off: float | None) -> str:
    return "n/a" if off is None else f"{off:+.1%}"


def _off(estimate: float | None, truth: float) -> float | None:
    return None if estimate is None or not truth else estimate / truth - 1


async def main_async(quick: bool, scales: tuple[float, ...] = (0.7, 1.0, 1.3)) -> dict[str, Any]:
    started = time.perf_counter()
    n = 80 if quick else 240
    sim = await start_simulator("--billing", "openai", "--models", MODEL, "--answer-words", str(ANSWER_WORDS),
                                "--latency-base-ms", "300")
    rows = []
    try:
        for workload in WORKLOADS:
            for scale in scales:
                for point in PRICE_POINTS:
                    row = await run_point(sim, workload, point, n, scale)
                    rows.append(row)
                    print(f"{workload.name}, token scale {scale}, {point}: {row['ratio']:.2f}x; alone_usd "
                          f"{_percent(row['alone_vs_direct'])} of the direct bill, actual_usd "
                          f"{_percent(row['actual_vs_bill'])} of its own", flush=True)
    finally:
        sim.stop()
    return {"meta": run_meta(started), "requests_per_run": n, "rate": RATE, "rows": rows}


def render(result: dict[str, Any]) -> str:
    columns = ["workload", "token_scale", "prices", "direct_usd", "broker_usd", "ratio", "direct_calls", "broker_calls", "wrong",
               "actual_vs_bill", "alone_vs_direct"]
    return format_table(result["rows"], columns)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="80 requests per run instead of 240")
    parser.add_argument("--scales", default="0.7,1.0,1.3",
                        help="upstream token counts as multiples of o200k_base's (default: %(default)s)")
    args = parser.parse_args(argv)
    result = asyncio.run(main_async(args.quick, tuple(float(s) for s in args.scales.split(","))))
    publish(result, render(result), results_path("cost.json"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
