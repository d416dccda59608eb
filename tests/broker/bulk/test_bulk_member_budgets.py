"""A Batch API job follows the live path's budget and cost rules: every line's answer ends at its own
`max_tokens` (finish_reason "length", usage to match), a merged reply the provider cut short answers those
who reached their budget and re-sends the rest alone, and lines merge only where merging pays.

The simulated upstream cuts every reply at `max_tokens` as providers do; its billing mode keeps a bill.
"""

from __future__ import annotations

import random

import pytest

from mergebroker.broker.bulk.settling import judge
from mergebroker.broker.engine.ground.tokens import count_text_tokens
from mergebroker.merge.compaction import CompactionRules, plan_compaction
from mergebroker.providers.simulator.content import compose_reply
from mergebroker.providers.simulator.faults import SimulatorConfig
from mergebroker.providers.simulator.server import answer_for, start_simulator
from tests.broker.bulk.test_batches_api import finished, outputs, run_batch
from tests.broker.engine.accounting.test_merge_pays import PRICE, SYSTEM
from tests.conftest import provider_for
from tests.merge.test_compaction import item

WORDS = 40  # answers of about 60 tokens


def row(custom_id: str, question: str, *, model: str = "sim-small", system: str | None = None, **extra) -> dict:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": messages, **extra}}


def config(sim, tmp_path, *, batch_api: bool = False, models: list[str] | None = None, **merge) -> dict:
    return {"providers": [provider_for(sim, batch_api=batch_api, **({"models": models} if models else {}))],
            "merge": {"embedder": "none", **merge}, "batches": {"dir": str(tmp_path), "poll_interval_s": 0.02},
            "tiers": [{"name": "batch", "priority": 0, "max_batch": 8, "similarity_threshold": 0.0}],
            "default_tier": "batch"}


async def run(broker, rows: list[dict]) -> dict[str, dict]:
    """Run `rows` as one batch through the SDK; each line's response body, by custom_id (all answered)."""
    batch = await finished(broker.openai, broker, await run_batch(broker.openai, broker, rows))
    assert batch.status == "completed" and batch.request_counts.completed == len(rows)
    found = await outputs(broker.openai, batch)
    assert {c: r["response"]["status_code"] for c, r in found.items()} == {r["custom_id"]: 200 for r in rows}
    return {c: r["response"]["body"] for c, r in found.items()}


@pytest.mark.parametrize("batch_api", [False, True])
async def test_every_line_ends_at_its_own_budget(simulator, start_broker, tmp_path, batch_api):
    simulator.set_faults(answer_words=WORDS)
    questions = [f"Explain part {n} of the maintenance handbook in detail" for n in range(8)]
    budgets = [6 + n for n in range(8)]
    rows = [row(f"q{n}", q, **{"max_completion_tokens" if n % 2 else "max_tokens": b})
            for n, (q, b) in enumerate(zip(questions, budgets))]
    broker = await start_broker(config(simulator, tmp_path, batch_api=batch_api))
    bodies = await run(broker, rows)
    for n, (question, budget) in enumerate(zip(questions, budgets)):
        body = bodies[f"q{n}"]
        choice = body["choices"][0]
        content = choice["message"]["content"]
        assert choice["finish_reason"] == "length", content
        assert content and answer_for(question, WORDS).startswith(content)
        assert count_text_tokens(content) <= budget and 0 < body["usage"]["completion_tokens"] <= budget
    stats = simulator.stats()
    # One merged call answers the first members (its budget fits only their budgets, and the model writes
    # whole answers); the others, with no block, were each re-sent alone.
    assert stats["merged_calls"] == 1 and stats["chat_calls"] < len(rows)


async def test_a_reply_cut_short_answers_who_reached_their_budget_and_resends_the_rest(simulator, start_broker,
                                                                                        tmp_path):
    simulator.set_faults(answer_words=WORDS)
    # "a" and "c" set no budget: the merged call holds the broker's default (30) for each, so it ends
    # inside "b"'s block once "a"'s whole answer is written.
    questions = {"a": "Explain the first chapter in detail", "b": "Explain the second chapter in detail",
                 "c": "Explain the third chapter in detail"}
    rows = [row("a", questions["a"]), row("b", questions["b"], max_tokens=10), row("c", questions["c"])]
    broker = await start_broker(config(simulator, tmp_path, default_max_tokens=30))
    bodies = await run(broker, rows)
    finish = {c: b["choices"][0]["finish_reason"] for c, b in bodies.items()}
    content = {c: b["choices"][0]["message"]["content"] for c, b in bodies.items()}
    assert finish == {"a": "stop", "b": "length", "c": "stop"}
    assert content["a"] == answer_for(questions["a"], WORDS) and content["c"] == answer_for(questions["c"], WORDS)
    assert content["b"] and answer_for(questions["b"], WORDS).startswith(content["b"])
    assert bodies["b"]["usage"]["completion_tokens"] <= 10
    assert simulator.stats()["chat_calls"] == 2  # the merged call, then "c" alone
    assert "max_tokens" not in simulator.last_request_body()  # alone, "c" keeps its own (absent) budget


async def bulk_bill(start_broker, tmp_path, rows: list[dict], **merge) -> tuple[float, int, int, dict | None]:
    """Run `rows` as a batch on priced model "m" against a billing upstream of its own: the bill (USD), its
    calls, its merged calls and the last request it received."""
    async with await start_simulator(SimulatorConfig(billing="openai", models=("m",))) as sim:
        broker = await start_broker({**config(sim, tmp_path, models=["m"], **merge), "pricing": {"m": PRICE}})
        await run(broker, rows)
        stats = sim.stats()
        return stats["bill"]["usd"], stats["chat_calls"], stats["merged_calls"], sim.last_request_body()


async def test_short_questions_are_not_compacted_where_merging_would_cost_more(start_broker, tmp_path):
    rows = [row(f"q{n}", f"What is {n} plus {n}?", model="m", max_tokens=40) for n in range(4)]
    alone_usd, calls, merged, _ = await bulk_bill(start_broker, tmp_path / "cost", rows)
    assert (calls, merged) == (4, 0)
    always_usd, calls, merged, _ = await bulk_bill(start_broker, tmp_path / "always", rows, policy="always")
    assert (calls, merged) == (1, 1)  # `merge.policy: always` compacts as before
    assert alone_usd < always_usd


async def test_a_long_shared_system_prompt_makes_compaction_pay(start_broker, tmp_path):
    rows = [row(f"q{n}", f"Question {n}: how do I reset device {n}?", model="m", system=SYSTEM, max_tokens=40)
            for n in range(4)]
    _, calls, merged, last = await bulk_bill(start_broker, tmp_path, rows)
    assert (calls, merged) == (1, 1)
    assert last["messages"][0]["content"] == SYSTEM  # sent once, for all four


def test_settling_cuts_each_member_at_its_own_budget_with_usage_to_match():
    items = [item("a", "What is a circuit breaker?", max_tokens=5), item("b", "Define merge window.")]
    (call,) = plan_compaction(items, CompactionRules(0.0, 4, lambda model: 100_000, count_tokens=count_text_tokens))
    answers = {m.tag: answer_for(items[n].shape.user_text, WORDS) for n, m in enumerate(call.members)}
    # The simulated upstream's own reply to the merged call: whole answers, in the format it reads.
    made = compose_reply(call.body["messages"], max_tokens=None, config=SimulatorConfig(answer_words=WORDS),
                         rng=random.Random(0))
    reply = {"model": "sim-small", "choices": [{"message": {"content": made.content}, "finish_reason": "stop"}],
             "usage": {"prompt_tokens": 90, "completion_tokens": made.completion_tokens}}
    results, retry = judge(call, reply, stop=None, leak_min_words=8)
    assert retry == {}
    by_line = {custom_id: body for custom_id, _, body in results}
    first, second = by_line["a"], by_line["b"]
    assert first["choices"][0]["finish_reason"] == "length" and first["usage"]["completion_tokens"] <= 5
    assert answers[call.members[0].tag].startswith(first["choices"][0]["message"]["content"])
    assert count_text_tokens(first["choices"][0]["message"]["content"]) <= 5
    assert second["choices"][0]["finish_reason"] == "stop"  # no budget of its own: never cut by the broker
    assert second["choices"][0]["message"]["content"] == answers[call.members[1].tag]
