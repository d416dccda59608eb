"""Merged streams: streaming requests share a merged call, and each caller streams only its own block."""

from __future__ import annotations

import asyncio
import json

from mergebroker.clock import FakeClock
from mergebroker.providers.simulator.server import answer_for
from tests.broker.engine.chat.test_early_release import gated  # noqa: F401 - the gated upstream fixture
from tests.broker.engine.limits.test_tiers_api import SubmitSpy

Q1 = "first question: how do tides form along a long rocky coast"
Q2 = "second question: why do cats purr when they are content"


def config(url: str, **tier) -> dict:
    return {"providers": [{"name": "up", "base_url": url}], "merge": {"embedder": "none"}, "cache": {"enabled": False},
            "tiers": [{"name": "batch", "window_ms": 50, "max_batch": 2, "similarity_threshold": 0.0,
                       "window_policy": "fixed", **tier}], "default_tier": "batch"}


async def stream(broker, question: str, **extra) -> tuple[int, dict, list[dict]]:
    """POST a streaming request; (status, headers, the parsed `data:` events but [DONE])."""
    body = {"model": "sim-small", "stream": True, "messages": [{"role": "user", "content": question}], **extra}
    async with broker.http.post("/v1/chat/completions", json=body) as resp:
        raw = await resp.read()
        events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" or "error" in events[-1]
        return resp.status, dict(resp.headers), [json.loads(e) for e in events if e != "[DONE]"]


def text_of(events: list[dict]) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))


def finish_of(events: list[dict]) -> str | None:
    return next((e["choices"][0]["finish_reason"] for e in events if e.get("choices") and
                 e["choices"][0].get("finish_reason")), None)


async def test_two_streams_share_one_call_and_each_gets_its_own_answer(simulator, start_broker):
    broker = await start_broker(config(simulator.url))
    results = await asyncio.gather(stream(broker, Q1, stream_options={"include_usage": True}), stream(broker, Q2))
    for (status, headers, events), question in zip(results, (Q1, Q2)):
        assert status == 200 and headers["X-Broker-Batch-Size"] == "2"
        assert text_of(events) == answer_for(question) and finish_of(events) == "stop"
        assert len({e["id"] for e in events}) == 1  # one stream of its own
    assert results[0][2][-1]["usage"]["completion_tokens"] > 0  # asked for usage: it comes last
    assert "usage" not in results[1][2][-1]
    assert simulator.stats()["chat_calls"] == 1 and simulator.stats()["stream_calls"] == 1
    samples = broker.broker.metrics.render().decode()
    assert 'mergebroker_merged_stream_ttft_seconds_count{position="2"} 1.0' in samples


async def test_streams_stay_alone_in_a_tier_without_merge_streams(simulator, start_broker):
    broker = await start_broker(config(simulator.url, merge_streams=False))
    results = await asyncio.gather(stream(broker, Q1), stream(broker, Q2))
    assert [r[1]["X-Broker-Batch-Size"] for r in results] == ["1", "1"]
    assert simulator.stats()["chat_calls"] == 2


async def test_a_leak_found_mid_stream_ends_that_stream_filtered(gated, start_broker):  # noqa: F811
    upstream, url = await gated(leak_second=True, by_word=True)
    upstream.gate.set()
    broker = await start_broker(config(url))
    results = dict(zip((Q1, Q2), await asyncio.gather(stream(broker, Q1), stream(broker, Q2))))
    assert finish_of(results[Q1][2]) == "stop" and text_of(results[Q1][2]) == f"answer to {Q1}"
    leaked = text_of(results[Q2][2])
    assert finish_of(results[Q2][2]) == "content_filter"
    assert leaked.startswith("answer to ") and Q1 not in leaked and "tides form along" not in leaked


async def test_a_block_lost_before_any_text_is_re_sent_alone_without_a_seam(gated, start_broker):  # noqa: F811
    upstream, url = await gated(break_after_first=True)
    broker = await start_broker(config(url))
    first, second = asyncio.create_task(stream(broker, Q1)), asyncio.create_task(stream(broker, Q2))
    await upstream.first_sent.wait()
    upstream.gate.set()
    results = dict(zip((Q1, Q2), await asyncio.gather(first, second)))
    assert text_of(results[Q1][2]) == f"answer to {Q1}"
    assert text_of(results[Q2][2]) == f"alone: {Q2}" and finish_of(results[Q2][2]) == "stop"
    assert upstream.bodies[-1]["messages"][-1]["content"] == Q2  # its own call


async def two_in_order(gated_upstream, start_broker, **upstream_options) -> tuple[list, list]:
    """Q1 then Q2 merged in this order (each queued before the next, on a fake clock), both streamed."""
    upstream, url = await gated_upstream(**upstream_options)
    upstream.gate.set()
    clock = FakeClock()
    broker = await start_broker({**config(url), "merge": {"embedder": "none", "leak_min_words": 3}}, clock=clock)
    spy = SubmitSpy(broker)
    first = asyncio.create_task(stream(broker, Q1))
    await spy.wait_for(1)
    second = asyncio.create_task(stream(broker, Q2))
    await spy.wait_for(2)
    clock.advance(0.05)
    return (await first)[2], (await second)[2]


async def test_a_stream_that_breaks_off_after_some_text_continues_from_its_own_call(gated, start_broker):  # noqa: F811
    first, second = await two_in_order(gated, start_broker, break_mid_second=True, by_word=True,
                                       alone_like_merged=True)
    assert text_of(first) == f"answer to {Q1}" and finish_of(first) == "stop"
    # Part of the second answer went out before the merged call broke off: the rest comes from its own call.
    assert text_of(second) == f"answer to {Q2}" and finish_of(second) == "stop"
    assert not any("error" in e for e in second) and len({e["id"] for e in second}) == 1


async def test_a_continued_stream_whose_own_answer_differs_ends_with_length(gated, start_broker):  # noqa: F811
    _, second = await two_in_order(gated, start_broker, break_mid_second=True, by_word=True)
    sent = text_of(second)
    assert f"answer to {Q2}".startswith(sent) and sent.startswith("answer to ")  # what went out stays the answer
    assert finish_of(second) == "length" and not any("error" in e for e in second)
