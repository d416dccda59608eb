"""Members' own budgets in merged calls, side by side with the same requests sent alone.

The issue's probe: rounds of 8 concurrent batch-tier requests whose `max_tokens` is smaller than their
answers, against the simulated upstream cutting every reply at `max_tokens` as providers do (`answer_words`
long answers). Each round runs twice on the same broker settings, once merging (the batch tier) and once
alone (`broker.merge: false`), plain and streamed. Per mode: members over their budget, finish reasons
other than "length", streams ending in an error event or without `[DONE]`, upstream calls, and the tokens
the upstream generated; ratios are merged / alone.

    python -m bench.member_budgets [--rounds N] [--budget TOKENS] [--words N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid
from typing import Any

import aiohttp
from aiohttp import web

from mergebroker.broker.engine.ground.config import load_settings
from mergebroker.broker.engine.ground.tokens import count_text_tokens
from mergebroker.broker.http.app import create_app
from mergebroker.providers.simulator.faults import SimulatorConfig
from mergebroker.providers.simulator.server import answer_for, start_simulator


async def one(session: aiohttp.ClientSession, question: str, budget: int, *, stream: bool, alone: bool
              ) -> dict[str, Any]:
    """Ask once; what the caller got: its text, finish reasons, completion tokens, errors, [DONE]."""
    body: dict[str, Any] = {"model": "sim-small", "max_tokens": budget,
                            "messages": [{"role": "user", "content": question}]}
    if alone:
        body["broker"] = {"merge": False}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    async with session.post("/v1/chat/completions", json=body, headers={"X-Broker-Tier": "batch"}) as resp:
        raw = await resp.read()
    if not stream:
        reply = json.loads(raw)
        choice = reply["choices"][0]
        return {"text": choice["message"]["content"], "finish": [choice["finish_reason"]], "error": False,
                "done": True, "completion": reply["usage"]["completion_tokens"]}
    events = [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e.startswith("data: ")]
    parsed = [json.loads(e) for e in events if e != "[DONE]"]
    usage = next((e["usage"] for e in parsed if e.get("usage")), {})
    return {"text": "".join(e["choices"][0]["delta"].get("content") or "" for e in parsed if e.get("choices")),
            "finish": [e["choices"][0]["finish_reason"] for e in parsed
                       if e.get("choices") and e["choices"][0].get("finish_reason")],
            "error": any("error" in e for e in parsed), "done": events[-1:] == ["[DONE]"],
            "completion": usage.get("completion_tokens", 0)}


async def run_mode(url: str, sim: Any, *, rounds: int, budget: int, words: int, stream: bool,
                   alone: bool) -> dict[str, Any]:
    """`rounds` rounds of 8 concurrent requests; the mode's counts."""
    before = sim.stats()
    results: list[tuple[str, dict[str, Any]]] = []
    async with aiohttp.ClientSession(base_url=url) as session:
        for _ in range(rounds):
            questions = [f"[{uuid.uuid4().hex[:6]}] explain part {i} of the handbook" for i in range(8)]
            answers = await asyncio.gather(*(one(session, q, budget, stream=stream, alone=alone) for q in questions))
            results += list(zip(questions, answers))
    after = sim.stats()
    return {
        "members": len(results),
        "over_budget": sum(count_text_tokens(r["text"]) > budget or r["completion"] > budget for _, r in results),
        "not_length": sum(r["finish"] != ["length"] for _, r in results),
        "not_prefix": sum(not answer_for(q, words).startswith(r["text"]) for q, r in results),
        "error_or_no_done": sum(r["error"] or not r["done"] for _, r in results),
        "upstream_calls": after["chat_calls"] - before["chat_calls"],
        "upstream_completion_tokens": after["completion_tokens"] - before["completion_tokens"],
        "upstream_prompt_tokens": after["prompt_tokens"] - before["prompt_tokens"],
    }


def ratio(new: float, base: float) -> str:
    return f"{new / base:.2f}" if base else "n/a"


async def main(rounds: int, budget: int, words: int) -> None:
    sim = await start_simulator(SimulatorConfig(answer_words=words))
    settings = load_settings(None, environ={}, overrides={
        "providers": [{"name": "sim", "base_url": sim.url}], "merge": {"embedder": "none"},
        "cache": {"enabled": False},
        "tiers": [{"name": "batch", "window_ms": 50, "max_batch": 8, "similarity_threshold": 0.0,
                   "window_policy": "fixed"}], "default_tier": "batch"})
    runner = web.AppRunner(create_app(settings), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    try:
        print(f"{rounds} rounds x 8 requests, max_tokens {budget}, answers of {words} words "
              f"(~{count_text_tokens(answer_for('x', words))} tokens)")
        print(f"{'mode':<9} {'metric':<28} {'merged':>8} {'alone':>8} {'merged/alone':>13}")
        for stream in (False, True):
            merged = await run_mode(url, sim, rounds=rounds, budget=budget, words=words, stream=stream, alone=False)
            alone = await run_mode(url, sim, rounds=rounds, budget=budget, words=words, stream=stream, alone=True)
            for metric in merged:
                print(f"{'stream' if stream else 'plain':<9} {metric:<28} {merged[metric]:>8} {alone[metric]:>8} "
                      f"{ratio(merged[metric], alone[metric]):>13}")
    finally:
        await runner.cleanup()
        await sim.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budget", type=int, default=10)
    parser.add_argument("--words", type=int, default=25)
    args = parser.parse_args()
    asyncio.run(main(args.rounds, args.budget, args.words))
