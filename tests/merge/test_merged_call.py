"""Live dispatch, bulk compaction and `mergebroker eval` build merged calls with one builder
(`merge.merged_call`): for the same members they send the same body, byte for byte, and settle each member
against the same budget and stop sequences."""

from __future__ import annotations

import asyncio
import json
import random

from mergebroker.broker.engine.ground.tokens import count_text_tokens
from mergebroker.broker.eval.cli import shipped_output_limit
from mergebroker.broker.eval.run import Evaluator, load_requests, plan_batches
from mergebroker.clock import FakeClock
from mergebroker.merge.compaction import BulkItem, CompactionRules, plan_compaction
from mergebroker.merge.merged_call import CallMember, CallRules, merged_call, own_budget
from mergebroker.merge.shape import merge_shape
from mergebroker.providers.openai.compat import HttpProviderSettings, OpenAICompatProvider
from tests.broker.engine.limits.test_tiers_api import SubmitSpy
from tests.conftest import provider_for

WINDOW_S = 0.2
# Longer IDs than a call of two would draw: their tags cost 9 tokens each, not the flat 7 of a count without
# the broker's tokenizer (what eval used to size merged calls with).
FIXED_IDS = ["K1234", "M5678", "P9012", "T3456"]
BODIES = [
    {"model": "sim-small", "temperature": 0, "max_tokens": 24, "stop": ["\n\n"],
     "messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2+3?"}]},
    {"model": "sim-small", "temperature": 0, "stop": ["\n\n"],  # no budget of its own: sized by the default
     "messages": [{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": "Name the capital of France (vitamin B12 aside)."}]},
]


def _fixed_ids(n: int, rng=None, *, avoid=()) -> list[str]:
    return FIXED_IDS[:n]


def _broker_config(sim) -> dict:
    return {"providers": [provider_for(sim, early_release=False)], "merge": {"embedder": "none"},
            "cache": {"enabled": False},
            "tiers": [{"name": "batch", "window_ms": WINDOW_S * 1000, "max_batch": 8, "similarity_threshold": 0.0,
                       "window_policy": "fixed"}], "default_tier": "batch"}


async def _live_merged_body(simulator, start_broker, bodies: list[dict]) -> dict:
    """The body the broker sends upstream for `bodies`, queued in this order and merged into one call."""
    clock = FakeClock()
    broker = await start_broker(_broker_config(simulator), clock=clock)
    spy = SubmitSpy(broker)

    async def post(body: dict) -> int:
        async with broker.http.post("/v1/chat/completions", json=body) as resp:
            await resp.read()
            return resp.status

    tasks = []
    for n, body in enumerate(bodies, 1):
        tasks.append(asyncio.create_task(post(body)))
        await spy.wait_for(n)
    clock.advance(WINDOW_S)
    assert await asyncio.gather(*tasks) == [200] * len(bodies)
    assert simulator.stats()["chat_calls"] == 1  # one merged call answered them all
    return simulator.last_request_body()


async def _eval_merged_body(simulator, bodies: list[dict]) -> dict:
    """The body `mergebroker eval` sends for `bodies` as one batch (its last call: the alone calls go first)."""
    requests = load_requests([json.dumps(b) for b in bodies], "sim-small")
    provider = OpenAICompatProvider(HttpProviderSettings(name="eval", base_url=simulator.url))

    async def chat(body: dict) -> dict:
        return await provider.chat(body, timeout=30)

    try:
        observation = await Evaluator(chat, requests, output_limit=shipped_output_limit).run([len(bodies)])
    finally:
        await provider.close()
    assert all(m.failure is None for m in observation.merged[0].members)
    return simulator.last_request_body()


async def test_live_and_eval_send_byte_identical_merged_bodies_for_the_same_members(simulator, start_broker,
                                                                                   monkeypatch):
    # Block IDs are the one thing drawn at random (`secrets` live, a seeded draw in eval): fixed here for both.
    monkeypatch.setattr("mergebroker.merge.merged_call.new_batch_ids", _fixed_ids)
    order = plan_batches(load_requests([json.dumps(b) for b in BODIES], "sim-small"), len(BODIES), seed=0)[0]
    bodies = [BODIES[i] for i in order]  # eval's batch order, so live queues them the same way
    live = await _live_merged_body(simulator, start_broker, bodies)
    from_eval = await _eval_merged_body(simulator, bodies)
    assert json.dumps(from_eval) == json.dumps(live)
    # What eval used to leave out: the broker's tokenizer sizes the tags (not a flat 7 per block).
    tags = sum(count_text_tokens(f"<{i}></{i}>\n") + 1 for i in FIXED_IDS[:2])
    assert live["max_tokens"] == 24 + 256 + tags != 24 + 256 + 2 * 7


def test_bulk_compaction_builds_the_call_the_shared_builder_builds():
    items = [BulkItem(f"line-{n}", body, f"fp-{n}", merge_shape(body), "key", 40, count_text_tokens(
        merge_shape(body).user_text), 24 if "max_tokens" in body else 256) for n, body in enumerate(BODIES)]
    rules = CompactionRules(0.0, 8, lambda model: 8192, count_tokens=count_text_tokens)
    [planned] = plan_compaction(items, rules, rng=random.Random(7))
    built = merged_call([CallMember(i.body, i.shape, i.max_tokens, i.prompt_tokens) for i in items],
                        CallRules(count_text_tokens), rng=random.Random(7))
    assert json.dumps(planned.body) == json.dumps(built.body)
    assert [m.settle_member(b.get("stop")) for m, b in zip(planned.members, BODIES)] == list(built.members)


def test_each_member_is_cut_at_its_own_budget_and_the_call_at_the_models_limit():
    members = [CallMember(b, merge_shape(b), 24 if "max_tokens" in b else 256, 40) for b in BODIES]
    call = merged_call(members, CallRules(count_text_tokens), output_limit=100)
    assert call.body["max_tokens"] == 100
    assert "stop" not in call.body and call.body["temperature"] == 0
    assert [m.max_tokens for m in call.members] == [24, None]  # the default sizes the call, cuts no answer
    assert [m.stop for m in call.members] == [["\n\n"], ["\n\n"]]
    assert [m.alone_prompt_tokens for m in call.members] == [40, 40]
    assert "B12" not in call.ids  # a member's own text names it: its answer would look like another's block
    assert own_budget({"max_completion_tokens": 9, "max_tokens": 30}) == 9 and own_budget({}) is None


def test_in_tagged_mode_each_members_leak_check_covers_its_own_system_prompt():
    members = [CallMember(b, merge_shape(b), 24) for b in BODIES]
    call = merged_call(members, CallRules(count_text_tokens, tagged_system=True))
    assert call.body["messages"][0]["role"] == "user"  # no shared system message
    assert [m.request_text for m in call.members] == [
        "Answer briefly.\n" + merge_shape(b).user_text for b in BODIES]
