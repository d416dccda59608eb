"""The bulk planner sends identical lines once, merges compatible ones within the limits, and keeps every line."""

from __future__ import annotations

import random

import numpy as np

from mergebroker.merge.compaction import BulkItem, CompactionRules, PlannedCall, plan_compaction
from mergebroker.merge.fingerprint import chat_fingerprint
from mergebroker.merge.member_budget import estimate_tokens
from mergebroker.merge.merge_cost import REQUEST_TAG_TOKENS
from mergebroker.merge.prompt import BLOCK_OVERHEAD_TOKENS, DEFAULT_HEADER, response_block, response_tag_tokens
from mergebroker.merge.settle import SettleOptions, settle
from mergebroker.merge.shape import compatibility_key, merge_shape
from mergebroker.providers.simulator.content import answer_for

RULES = CompactionRules(threshold=0.0, max_batch=4, budget=lambda model: 100_000)


def item(custom_id: str, text: str, *, system: str = "Classify.", model: str = "sim-small", **extra) -> BulkItem:
    body = {"model": model, "messages": [{"role": "system", "content": system}, {"role": "user", "content": text}],
            **extra}
    shape = merge_shape(body)
    key = compatibility_key(body, shape, scope_value="tenant:a") if shape else None
    return BulkItem(custom_id, body, chat_fingerprint(body), shape, key, prompt_tokens=10, user_tokens=4,
                    max_tokens=int(extra.get("max_tokens", 50)))


def test_identical_lines_share_one_member_and_every_line_is_planned_once():
    items = [item("a", "red"), item("b", "Red "), item("c", "blue"), item("d", "green")]
    calls = plan_compaction(items, RULES, rng=random.Random(1))
    assert len(calls) == 1 and calls[0].merged
    assert [m.custom_ids for m in calls[0].members] == [("a", "b"), ("c",), ("d",)]
    assert sorted(c for call in calls for c in call.custom_ids) == ["a", "b", "c", "d"]


def test_max_batch_budget_and_compatibility_split_groups():
    items = [item(str(n), f"item {n}") for n in range(9)] + [item("other", "x", system="Summarise.")]
    calls = plan_compaction(items, RULES)
    assert [len(c.members) for c in calls] == [4, 4, 1, 1]
    assert calls[2].members[0].custom_ids == ("8",) and not calls[2].merged
    assert calls[3].body["messages"][0]["content"] == "Summarise."
    # The window holds the header and the shared system prompt once, and two members (each its prompt less the
    # shared prompt, its budget and its tags): not three.
    member = 10 - estimate_tokens("Classify.") + 50 + BLOCK_OVERHEAD_TOKENS + REQUEST_TAG_TOKENS
    window = estimate_tokens(DEFAULT_HEADER) + estimate_tokens("Classify.") + 2 * member
    tight = CompactionRules(threshold=0.0, max_batch=8, budget=lambda model: window)
    assert [len(c.members) for c in plan_compaction(items[:4], tight)] == [2, 2]


def test_unmergeable_lines_go_alone_and_similarity_needs_vectors():
    items = [item("t", "call a tool", tools=[{"type": "function"}]), item("u", "one"), item("v", "two")]
    calls = plan_compaction(items, RULES)
    assert [c.custom_ids for c in calls] == [["t"], ["u", "v"]]
    strict = CompactionRules(threshold=0.9, max_batch=4, budget=lambda model: 10_000)
    assert len(plan_compaction(items[1:], strict)) == 2  # no vectors: never merged on a guess
    vectors = {"u": np.array([1.0, 0.0]), "v": np.array([0.99, 0.141])}
    assert len(plan_compaction(items[1:], strict, vectors=vectors)) == 1


def test_merged_call_settles_back_to_each_member_and_round_trips_as_json():
    items = [item("a", "What is a circuit breaker?", max_tokens=40), item("b", "Define merge window.")]
    (call,) = plan_compaction(items, RULES)
    tags = sum(response_tag_tokens(m.tag, estimate_tokens) for m in call.members)
    assert call.body["max_tokens"] == 40 + 50 + tags and "stop" not in call.body
    assert PlannedCall.from_json(call.to_json()) == call
    blocks = "\n".join(response_block(m.tag, answer_for(items[n].shape.user_text))
                       for n, m in enumerate(call.members))
    reply = {"choices": [{"message": {"content": blocks}, "finish_reason": "stop"}],
             "usage": {"prompt_tokens": 90, "completion_tokens": 40}}
    settled = settle(reply, [m.settle_member(None) for m in call.members], SettleOptions(leak_min_words=8))
    texts = {tag: answer.text for tag, answer in settled.answers.items()}
    assert texts == {call.members[0].tag: answer_for("What is a circuit breaker?"),
                     call.members[1].tag: answer_for("Define merge window.")}
    assert sum(a.usage.prompt_tokens for a in settled.answers.values()) == 90
    assert settled.fallbacks == {}
