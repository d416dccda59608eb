"""Bulk-job benchmark: one batch file compacted by the broker against the same lines sent one by one.

The file holds `lines` short classification and extraction items under two system prompts, with about
10% repeated lines (`bulk_file`). Three runs against one simulated upstream with realistic latency,
its counters reset before each:

- `line_by_line`: every line sent as its own chat call straight to the simulator, `concurrency` at a time
  (what a gateway that passes a batch file through sends);
- `compacted_pool`: the file through the broker's Batch API with the official SDK, executed through
  the provider pools (`batches.concurrency` = `concurrency` compacted calls at a time);
- `compacted_batch_api`: the same, with the provider's own Batch API (`batch_api: true`).

Each run reports upstream calls, prompt and completion tokens (the simulator's counters), wall time,
and wrong answers: every `custom_id`'s answer is checked against the simulator's `answer_for` of its own
question. `python -m bench.bulk [--quick] [--out FILE]` writes `bench/results/bulk.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
import openai

from bench.harness import (
    Process,
    cpu_probe_ms,
    get_json,
    post_json,
    processes_together,
    results_path,
    run_meta,
    sim_base_url,
    start_broker,
    start_simulator,
    write_results,
)
from mergebroker.providers.simulator.server import answer_for

MODEL = "sim-small"
SIM_OPTIONS = ("--latency-base-ms", "200", "--latency-per-token-ms", "1")
SYSTEMS = (  # realistic bulk instructions: a task, its labels and the output format, sent with every line
    "You label customer reviews of a home electronics and kitchen shop for the quality team. Read the review "
    "and decide its sentiment: positive (the customer is satisfied, praises the product, the price or the "
    "delivery), negative (the customer reports a defect, damage, a missing part, a bad experience with support "
    "or delivery, or asks for a refund) or neutral (a question, a mixed opinion, or a fact without a judgement). "
    "Sarcasm counts as negative. A review that praises the product but complains about the delivery is mixed, "
    "so neutral. Answer with the label in lower case, a colon, and a reason of at most ten words that quotes no "
    "personal data. Do not add greetings, explanations of the labels or anything else.",
    "You extract structured facts from customer messages for the returns desk of a home electronics and kitchen "
    "shop. Find the product the customer talks about, using the shop's product type (kettle, headphones, desk "
    "lamp, backpack, router, keyboard and so on) rather than a brand, and the problem reported, in at most six "
    "words. If no problem is reported, write 'none'. If several products are named, use the one the problem is "
    "about. Answer exactly as 'product: problem' on one line, in lower case, without quotes, punctuation at the "
    "end, personal data, order numbers or any other text.",
)
PRODUCTS = ("kettle", "headphones", "desk lamp", "backpack", "phone case", "coffee grinder", "router", "keyboard",
            "water bottle", "blender", "monitor", "running shoes", "toaster", "smart watch", "vacuum cleaner")
OPINIONS = ("stopped working after a week", "is exactly what I hoped for", "arrived with a cracked lid",
            "is louder than the old one", "charges much faster than advertised", "has a confusing manual",
            "was cheaper elsewhere", "feels solid and well made", "keeps disconnecting", "smells of plastic")


@dataclass(frozen=True)
class Plan:
    """Sizes of the run; `QUICK` is a smoke-sized copy."""

    lines: int = 1000
    duplicate_share: float = 0.1
    concurrency: int = 8
    max_tokens: int = 40


FULL = Plan()
QUICK = Plan(lines=60)


def bulk_file(plan: Plan, seed: int = 11) -> list[dict[str, Any]]:
    """The batch input lines: two system prompts, short items, `duplicate_share` of them repeats."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    for n in range(plan.lines):
        if rows and rng.random() < plan.duplicate_share:
            body = rows[rng.randrange(len(rows))]["body"]
        else:
            item = f"Review {n}: the {rng.choice(PRODUCTS)} {rng.choice(OPINIONS)}."
            body = {"model": MODEL, "max_tokens": plan.max_tokens, "temperature": 0,
                    "messages": [{"role": "system", "content": SYSTEMS[n % 2]}, {"role": "user", "content": item}]}
        rows.append({"custom_id": f"line-{n}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    return rows


def question(row: dict[str, Any]) -> str:
    """The user text of a line (what its answer must be the answer to)."""
    return row["body"]["messages"][-1]["content"]


async def line_by_line(sim: Process, rows: list[dict[str, Any]], plan: Plan) -> dict[str, str]:
    """Every line as its own call to the simulator; custom_id -> answer text."""
    slots = asyncio.Semaphore(plan.concurrency)
    answers: dict[str, str] = {}
    async with aiohttp.ClientSession() as session:
        async def one(row: dict[str, Any]) -> None:
            async with slots, session.post(sim_base_url(sim) + "/chat/completions", json=row["body"]) as resp:
                answers[row["custom_id"]] = (await resp.json())["choices"][0]["message"]["content"]
        await asyncio.gather(*(one(r) for r in rows))
    return answers


async def through_broker(broker: Process, rows: list[dict[str, Any]]) -> dict[str, str]:
    """The file through the broker's Batch API with the official SDK; custom_id -> answer text."""
    client = openai.AsyncOpenAI(base_url=broker.url + "/v1", api_key="bench", max_retries=0)
    try:
        data = "".join(json.dumps(r) + "\n" for r in rows).encode()
        uploaded = await client.files.create(file=("bulk.jsonl", data), purpose="batch")
        batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            await asyncio.sleep(0.05)  # polling as a batch client does: the job runs in the broker process
            batch = await client.batches.retrieve(batch.id)
        answers: dict[str, str] = {}
        for file_id in (batch.output_file_id, batch.error_file_id):
            for raw in ((await client.files.content(file_id)).text.splitlines() if file_id else []):
                row = json.loads(raw)
                body = (row.get("response") or {}).get("body") or {}
                choices = body.get("choices") or [{}]
                answers[row["custom_id"]] = (choices[0].get("message") or {}).get("content") or _error(row)
        return answers
    finally:
        await client.close()


def _error(row: dict[str, Any]) -> str:
    """An error line's code, kept as its "answer" (it is counted wrong, and the report shows which errors)."""
    error = row.get("error") or ((row.get("response") or {}).get("body") or {}).get("error") or {}
    return f"error: {error.get('code') or error.get('type') or 'unknown'}"


def broker_config(sim: Process, plan: Plan, *, batch_api: bool) -> dict[str, Any]:
    return {"providers": [{"name": "sim", "base_url": sim_base_url(sim), "batch_api": batch_api}],
            "merge": {"embedder": "none"}, "cache": {"enabled": False},
            "batches": {"dir": tempfile.mkdtemp(prefix="mb-bench-bulk-"), "concurrency": plan.concurrency,
                        "poll_interval_s": 0.1}}


async def measure(sim: Process, name: str, rows: list[dict[str, Any]], send: Any) -> dict[str, Any]:
    """One run: reset the simulator's counters, send, read them back, check every answer."""
    await post_json(sim.url + "/stats/reset", {})
    started = time.perf_counter()
    answers = await send()
    wall_s = time.perf_counter() - started
    stats = await get_json(sim.url + "/stats")
    wrong = sum(1 for r in rows if answers.get(r["custom_id"]) != answer_for(question(r)))
    missing = sum(1 for r in rows if r["custom_id"] not in answers)
    errors = Counter(a for a in answers.values() if a.startswith("error: "))
    return {"name": name, "lines": len(rows), "answered": len(answers), "missing": missing, "wrong_answers": wrong,
            "upstream_calls": stats["chat_calls"], "merged_calls": stats["merged_calls"],
            "prompt_tokens": stats["prompt_tokens"], "completion_tokens": stats["completion_tokens"],
            "wall_s": round(wall_s, 2), "errors": dict(errors)}


async def run(plan: Plan) -> dict[str, Any]:
    """All three runs side by side, with ratios against line by line."""
    started, probe = time.perf_counter(), cpu_probe_ms()
    rows = bulk_file(plan)
    async with processes_together(start_simulator(*SIM_OPTIONS)) as (sim,):
        runs = [await measure(sim, "line_by_line", rows, lambda: line_by_line(sim, rows, plan))]
        for name, batch_api in (("compacted_pool", False), ("compacted_batch_api", True)):
            async with processes_together(start_broker(broker_config(sim, plan, batch_api=batch_api))) as (broker,):
                runs.append(await measure(sim, name, rows, lambda: through_broker(broker, rows)))
    base = runs[0]
    for r in runs[1:]:
        r["calls_ratio"] = round(base["upstream_calls"] / max(1, r["upstream_calls"]), 2)
        r["prompt_tokens_ratio"] = round(base["prompt_tokens"] / max(1, r["prompt_tokens"]), 2)
        r["wall_ratio"] = round(base["wall_s"] / max(0.01, r["wall_s"]), 2)
    distinct = len({json.dumps(r["body"], sort_keys=True) for r in rows})
    return {"plan": asdict(plan), "distinct_lines": distinct, "runs": runs, "meta": run_meta(started, probe)}


def report(result: dict[str, Any]) -> str:
    """A plain-text table of the runs."""
    lines = [f"{'run':22} {'calls':>6} {'prompt tok':>10} {'wall s':>7} {'wrong':>5} {'calls x':>7} {'tokens x':>8}"]
    for r in result["runs"]:
        lines.append(f"{r['name']:22} {r['upstream_calls']:>6} {r['prompt_tokens']:>10} {r['wall_s']:>7} "
                     f"{r['wrong_answers'] + r['missing']:>5} {r.get('calls_ratio', 1.0):>7} "
                     f"{r.get('prompt_tokens_ratio', 1.0):>8}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: run, write the JSON, print the table."""
    parser = argparse.ArgumentParser(prog="python -m bench.bulk", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny run (seconds), for the smoke test")
    parser.add_argument("--out", default=str(results_path("bulk.json")), help="JSON output file")
    args = parser.parse_args(argv)
    result = asyncio.run(run(QUICK if args.quick else FULL))
    write_results(args.out, result)
    print(report(result))
    return 0 if all(r["wrong_answers"] == 0 and r["missing"] == 0 for r in result["runs"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
