"""Agent conversations through the broker at its defaults: its CPU per turn while each turn sends the whole
conversation again, against another checkout's broker side by side.

Agents (Claude Code, Codex CLI, the SDKs' agent loops) send their system prompt and every earlier turn on each
request, so a conversation's prompt grows turn by turn. The broker counts each prompt's tokens before it sends
it (limits, the ledger, merge planning) and, for a priced model, models the provider's prompt cache on its
tokens. Here `--agents` agents each hold a conversation of `--turns` turns, one request at a time: one long
system prompt shared by all (as one agent product's is), a new user message per turn and the simulator's
answer kept in the history, and the agent's tools named in every request (so, as for a real agent, nothing
merges). Every agent starts over in each round with new texts, so rounds are alike; the
model is priced (with OpenAI's cache style) so that the prompt-cache model runs as it does for a real one.
Rounds are interleaved and alternate their order; CPU is the broker process's scheduler run time over a round.

    python -m bench.conversations [--agents 8] [--turns 12] [--rounds 3] [--old-checkout PATH] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from bench.harness import (
    CpuWindow,
    Process,
    cpu_vs_old,
    format_table,
    new_and_old,
    percentile,
    processes,
    publish,
    results_path,
    run_meta,
    sim_base_url,
    start_simulator,
)

_WORDS = ("the broker counts every prompt before it sends it so that limits prices and plans hold when "
          "agents send their whole conversation again on each turn def return import class self value").split()
SYSTEM_WORDS = 3000  # about 3,500 tokens, the order of an agent product's instructions and tool notes
USER_WORDS = 300
TOOLS = [{"type": "function", "function": {
    "name": name, "description": f"{name} in the workspace",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
    for name in ("read_file", "write_file", "run_tests")]


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def broker_config(upstream: str) -> dict[str, Any]:
    """The broker at its defaults (merging, cache, the default tiers), with the simulator's model priced."""
    return {"providers": [{"name": "sim", "base_url": upstream}],
            "pricing": {"sim-small": {"input": 2.5, "cached_input": 1.25, "output": 10.0, "cache": "openai"}}}


async def _round(url: str, agents: int, turns: int, seed: int) -> dict[str, Any]:
    """Each agent holds one conversation of `turns` requests, one at a time; latencies and errors."""
    rng = random.Random(seed)
    system = _text(rng, SYSTEM_WORDS)
    questions = [[_text(rng, USER_WORDS) for _ in range(turns)] for _ in range(agents)]
    latencies: list[float] = []
    errors = 0
    async with aiohttp.ClientSession() as session:
        async def agent(n: int) -> None:
            nonlocal errors
            history: list[dict[str, str]] = [{"role": "system", "content": system}]
            for question in questions[n]:
                history.append({"role": "user", "content": f"agent {seed}-{n}: {question}"})
                started = time.perf_counter()
                async with session.post(url + "/v1/chat/completions",
                                        json={"model": "sim-small", "max_tokens": 64, "messages": history,
                                              "tools": TOOLS}) as resp:
                    body = await resp.json()
                latencies.append((time.perf_counter() - started) * 1000)
                if resp.status != 200:
                    errors += 1
                    return
                history.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})

        await asyncio.gather(*(agent(n) for n in range(agents)))
    return {"latencies": latencies, "errors": errors}


async def _measure(target: Process, agents: int, turns: int, seed: int) -> dict[str, Any]:
    window = CpuWindow(target)
    result = await _round(target.url, agents, turns, seed)
    return {"cpu_ms": window.ms_per(agents * turns), "p50_ms": percentile(result["latencies"], 50),
            "errors": result["errors"]}


async def run(agents: int, turns: int, rounds: int, old_checkout: Path | None) -> dict[str, Any]:
    started = time.perf_counter()
    async with processes(start_simulator("--latency-base-ms", "0")) as (sim,):
        config = broker_config(sim_base_url(sim))
        measured = await new_and_old(config, old_checkout, lambda target: _round(target.url, 2, 2, seed=0),
                                     lambda target, n: _measure(target, agents, turns, seed=n + 1), rounds)
    rows = [{"target": name, "cpu_ms_per_turn": statistics.median(r["cpu_ms"] for r in runs),
             "p50_ms": statistics.median(r["p50_ms"] for r in runs), "errors": sum(r["errors"] for r in runs)}
            for name, runs in measured.items()]
    ratios = cpu_vs_old(measured)
    return {"agents": agents, "turns": turns, "rounds": rounds, "rows": rows, "ratios": ratios,
            "meta": run_meta(started)}


def report(result: dict[str, Any]) -> str:
    lines = [f"Agent conversations at the broker's defaults ({result['agents']} agents x {result['turns']} turns, "
             f"each turn sending the whole conversation; medians over {result['rounds']} interleaved rounds; "
             "CPU: the broker process's)",
             format_table(result["rows"], ["target", "cpu_ms_per_turn", "p50_ms", "errors"])]
    lines += [f"{name} (paired median): {value:.3f}x" for name, value in result["ratios"].items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run, print the table and write the JSON."""
    parser = argparse.ArgumentParser(prog="python -m bench.conversations", description=__doc__.split("\n")[0])
    parser.add_argument("--agents", type=int, default=8, help="conversations held at once")
    parser.add_argument("--turns", type=int, default=12, help="requests per conversation")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--old-checkout", type=Path, help="also run that checkout's broker, side by side")
    parser.add_argument("--quick", action="store_true", help="a tiny run (seconds), for the smoke test")
    parser.add_argument("--out", help="JSON output file")
    args = parser.parse_args(argv)
    agents, turns, rounds = (2, 3, 1) if args.quick else (args.agents, args.turns, args.rounds)
    result = asyncio.run(run(agents, turns, rounds, args.old_checkout))
    publish(result, report(result), args.out or str(results_path("conversations.json")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
