"""Streams carry their usage to the ledger: the provider's usage chunk (kept from a caller that did not ask
for it) or the broker's count; a merged member's stream continues from its own call without a seam."""

from __future__ import annotations

import json

from mergebroker.broker.engine.chat.member_stream import MemberStream
from mergebroker.broker.engine.chat.stream_usage import MeteredStream, caller_wants_usage, with_usage_requested
from mergebroker.token_usage import TokenUsage

USAGE = {"prompt_tokens": 12, "completion_tokens": 4, "total_tokens": 16}


def chunk(text: str | None = None, finish: str | None = None, usage: dict | None = None) -> bytes:
    choices = [] if usage is not None else [{"index": 0, "delta": {"content": text} if text else {},
                                             "finish_reason": finish}]
    return b"data: " + json.dumps({"id": "c", "choices": choices, "usage": usage}).encode() + b"\n\n"


async def upstream(*chunks: bytes):
    for c in chunks:
        yield c
    yield b"data: [DONE]\n\n"


async def relayed(stream) -> list[bytes]:
    return [c async for c in stream]


def test_the_usage_chunk_is_asked_for_upstream_keeping_the_callers_other_options():
    assert with_usage_requested({"stream_options": {"x": 1}})["stream_options"] == {"x": 1, "include_usage": True}
    assert with_usage_requested({})["stream_options"] == {"include_usage": True}
    assert caller_wants_usage({"stream_options": {"include_usage": True}}) and not caller_wants_usage({})


async def test_a_caller_that_did_not_ask_gets_no_usage_chunk_but_the_ledger_gets_the_usage():
    metered = MeteredStream(upstream(chunk("Hi"), chunk(finish="stop"), chunk(usage=USAGE)), relay_usage=False,
                            prompt_tokens=99)
    sent = await relayed(metered)
    assert not any(b'"total_tokens"' in c for c in sent) and sent[-1] == b"data: [DONE]\n\n"
    assert await metered.usage == TokenUsage(12, 4)


async def test_a_caller_that_asked_gets_the_usage_chunk():
    metered = MeteredStream(upstream(chunk("Hi"), chunk(usage=USAGE)), relay_usage=True, prompt_tokens=0)
    assert sum(b'"total_tokens"' in c for c in await relayed(metered)) == 1


async def test_without_a_usage_chunk_the_usage_is_counted_and_marked_so():
    metered = MeteredStream(upstream(chunk("Hello there"), chunk(" friend"), chunk(finish="stop")),
                            relay_usage=False, prompt_tokens=7)
    await relayed(metered)
    assert await metered.usage == TokenUsage(7, 3, counted=True)


async def test_a_stream_closed_before_it_was_read_still_settles_its_usage():
    metered = MeteredStream(upstream(chunk("x")), relay_usage=False, prompt_tokens=5)
    await metered.aclose()
    assert (await metered.usage).counted


async def events_of(stream: MemberStream) -> tuple[str, list[str], list[dict]]:
    parsed = [json.loads(e[6:]) for e in (await relayed(stream))[:-1]]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in parsed if e["choices"])
    finishes = [e["choices"][0]["finish_reason"] for e in parsed if e["choices"] and e["choices"][0]["finish_reason"]]
    return text, finishes, parsed


async def test_a_resumed_stream_skips_what_was_sent_and_ends_as_its_own_call_ends():
    stream = MemberStream(model="m", include_usage=True)
    stream.release("The answer ")
    stream.release("is for")
    stream.resume_with(upstream(chunk("The ans"), chunk("wer is fort"), chunk("y-two."), chunk(finish="length"),
                                chunk(usage=USAGE)))
    text, finishes, parsed = await events_of(stream)
    assert text == "The answer is forty-two." and finishes == ["length"]
    assert parsed[-1]["usage"] == USAGE and len({e["id"] for e in parsed}) == 1


async def test_a_resumed_stream_whose_new_answer_differs_ends_with_length_where_the_sent_text_ends():
    stream = MemberStream(model="m", include_usage=False)
    stream.release("The answer is")
    stream.resume_with(upstream(chunk("An answer"), chunk(" is"), chunk(finish="stop")))
    text, finishes, _ = await events_of(stream)
    assert text == "The answer is" and finishes == ["length"]
