"""Every member of a merged call gets what it asked for: its answer ends at its own `max_tokens`, with
`finish_reason: "length"` and usage to match, whole-reply or released early, plain or streamed; a merged
stream cut short continues from a call of its own and never ends in an error event.

The simulated upstream answers with long answers (`answer_words`) and cuts every reply at `max_tokens` as
providers do, so the merged call's own limit cuts later blocks short too.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from mergebroker.broker.engine.ground.tokens import count_text_tokens
from mergebroker.clock import FakeClock
from mergebroker.providers.simulator.server import answer_for
from tests.broker.engine.limits.test_tiers_api import SubmitSpy
from tests.broker.http.test_conformance import assert_matches
from tests.conftest import provider_for

WORDS = 40  # answers of about 60 tokens
WINDOW_S = 0.2
QUESTIONS = [f"Explain part {i} of the maintenance handbook in detail" for i in range(8)]


def config(sim, *, early_release: bool = True) -> dict:
    return {"providers": [provider_for(sim, early_release=early_release)], "merge": {"embedder": "none"},
            "cache": {"enabled": False},
            "tiers": [{"name": "batch", "window_ms": WINDOW_S * 1000, "max_batch": 8, "similarity_threshold": 0.0,
                       "window_policy": "fixed"}], "default_tier": "batch"}


async def started(simulator, start_broker, **options):
    simulator.set_faults(answer_words=WORDS)
    clock = FakeClock()
    return await start_broker(config(simulator, **options), clock=clock), clock


async def in_order(broker, clock: FakeClock, requests: list) -> list:
    """Start `requests` (coroutine factories) one by one, each queued before the next, then close the window:
    the merged call holds them in this order whatever the machine's speed."""
    spy = SubmitSpy(broker)
    tasks = []
    for n, request in enumerate(requests, 1):
        tasks.append(asyncio.create_task(request()))
        await spy.wait_for(n)
    clock.advance(WINDOW_S)
    return await asyncio.gather(*tasks)


async def stream(broker, question: str, max_tokens: int, *, include_usage: bool = True) -> tuple[dict, list[dict]]:
    """A streaming request: (headers, its events but [DONE]); it must end with [DONE] and no error event."""
    body = {"model": "sim-small", "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": question}]}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    async with broker.http.post("/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        raw = (await resp.read()).decode()
        headers = dict(resp.headers)
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    parsed = [json.loads(e) for e in events[:-1]]
    assert not any("error" in e for e in parsed), parsed[-2:]
    return headers, parsed


def text_of(events: list[dict]) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))


def finish_of(events: list[dict]) -> list[str]:
    return [e["choices"][0]["finish_reason"] for e in events if e.get("choices") and e["choices"][0]["finish_reason"]]


@pytest.mark.parametrize("early_release", [True, False])
async def test_merged_members_end_at_their_own_budget(simulator, start_broker, early_release):
    broker, clock = await started(simulator, start_broker, early_release=early_release)
    results = await in_order(broker, clock, [lambda q=q: broker.chat(q, max_tokens=10) for q in QUESTIONS])
    for question, (status, body, headers) in zip(QUESTIONS, results):
        assert status == 200, body
        content, choice = body["choices"][0]["message"]["content"], body["choices"][0]
        assert choice["finish_reason"] == "length", (headers.get("X-Broker-Fallback"), content)
        assert answer_for(question, WORDS).startswith(content) and content
        assert 0 < body["usage"]["completion_tokens"] <= 10
        assert count_text_tokens(content) <= 10
        assert_matches(body, "CreateChatCompletionResponse")
    answered_from_merged = [h for _, _, h in results if "X-Broker-Fallback" not in h]
    assert len(answered_from_merged) >= 2  # the merged call's budget fits more than one member's block


async def test_the_merged_budget_is_the_members_budgets_plus_their_tags(simulator, start_broker):
    broker, clock = await started(simulator, start_broker)
    simulator.set_faults(answer_words=5)  # short answers: nothing is cut, one merged call answers all
    questions = QUESTIONS[:3]
    results = await in_order(broker, clock, [lambda q=q, n=n: broker.chat(q, max_tokens=20 + n)
                                             for n, q in enumerate(questions)])
    assert all(b["choices"][0]["finish_reason"] == "stop" for _, b, _ in results)
    merged = simulator.last_request_body()
    assert 20 + 21 + 22 + 3 * 6 <= merged["max_tokens"] <= 20 + 21 + 22 + 3 * 8  # each block's tags: 7 tokens
    assert simulator.stats()["chat_calls"] == 1


async def test_merged_streams_end_at_their_own_budget_with_done_and_no_error(simulator, start_broker):
    broker, clock = await started(simulator, start_broker)
    results = await in_order(broker, clock, [lambda q=q: stream(broker, q, 10) for q in QUESTIONS])
    for question, (headers, events) in zip(QUESTIONS, results):
        text = text_of(events)
        assert finish_of(events) == ["length"], (headers.get("X-Broker-Fallback"), text)
        assert answer_for(question, WORDS).startswith(text) and text
        assert count_text_tokens(text) <= 10
        assert 0 < events[-1]["usage"]["completion_tokens"] <= 10  # asked for usage: it comes last
        assert len({e["id"] for e in events}) == 1
        for event in events:
            assert_matches(event, "CreateChatCompletionStreamResponse")
    assert {h["X-Broker-Batch-Size"] for h, _ in results} == {"8"}


async def test_a_stream_cut_after_some_of_its_text_continues_from_its_own_call(simulator, start_broker):
    broker, clock = await started(simulator, start_broker)
    first_q, second_q = QUESTIONS[:2]
    # Budgets 40 and 50 make a merged budget of about 116: the first block (its whole answer, about 70
    # tokens with its tags) leaves the second about 40 of its 50 tokens. Some of its text went out, so the
    # rest comes from a call of its own, relayed from where the block broke off.
    (_, first), (_, second) = await in_order(broker, clock, [lambda: stream(broker, first_q, 40),
                                                             lambda: stream(broker, second_q, 50)])
    assert finish_of(first) == ["length"] and answer_for(first_q, WORDS).startswith(text_of(first))
    text = text_of(second)
    assert answer_for(second_q, WORDS).startswith(text) and 48 <= count_text_tokens(text) <= 51
    assert finish_of(second) == ["length"]
    assert simulator.stats()["chat_calls"] == 2  # the merged call, and the second member's own
    assert simulator.last_request_body()["max_tokens"] == 50


async def test_a_caller_that_did_not_ask_for_usage_gets_no_usage_chunk(simulator, start_broker):
    broker, clock = await started(simulator, start_broker)
    results = await in_order(broker, clock, [lambda q=q: stream(broker, q, 10, include_usage=False)
                                             for q in QUESTIONS[:2]])
    for _, events in results:
        assert all(e.get("usage") is None for e in events) and finish_of(events) == ["length"]
