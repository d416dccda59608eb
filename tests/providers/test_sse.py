"""Stream events of an OpenAI chat completion read as text, finish reason and usage, never as an exception."""

from __future__ import annotations

import json

import pytest

from mergebroker.providers.sse import chat_event


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_a_content_chunk_gives_its_text_and_metadata():
    event = chat_event(sse({"id": "c1", "model": "m", "created": 5,
                            "choices": [{"index": 0, "delta": {"content": "hi "}, "finish_reason": None}]}))
    assert event.text == "hi " and event.finish_reason is None and not event.done
    assert event.meta == {"id": "c1", "model": "m", "created": 5}


def test_finish_usage_and_done():
    assert chat_event(sse({"choices": [{"delta": {}, "finish_reason": "length"}]})).finish_reason == "length"
    usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert chat_event(sse({"choices": [], "usage": usage})).usage == usage
    assert chat_event(b"data: [DONE]\n\n").done


@pytest.mark.parametrize("raw", [b": keep-alive\n\n", b"data: {not json\n\n", b"data: [1, 2]\n\n", b"",
                                 b'data: {"choices": "x"}\n\n', b'data: {"choices": [{"delta": {"content": 5}}]}\n\n'])
def test_anything_else_reads_as_empty(raw):
    event = chat_event(raw)
    assert event.text == "" and event.finish_reason is None and event.usage is None and not event.done
