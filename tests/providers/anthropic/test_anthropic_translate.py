"""Chat completions translate to Anthropic Messages and back: fields carried or refused by name, finish reasons,
usage, streams and errors mapped the way OpenAI clients expect."""

from __future__ import annotations

import json

import pytest

from mergebroker.errors import UpstreamBadResponse, UpstreamHTTPError, UpstreamUnsupported
from mergebroker.providers.anthropic.errors import OVERLOADED_RETRY_AFTER_S, to_error
from mergebroker.providers.anthropic.reply import to_completion
from mergebroker.providers.anthropic.stream import DONE, StreamTranslator
from mergebroker.providers.anthropic.translate import to_messages
from tests.helpers.sse import event

USER = [{"role": "user", "content": "hello"}]


def translate(**body):
    return to_messages({"model": "m", "messages": USER, **body}, default_max_tokens=256).body


def test_system_and_developer_messages_become_the_system_field_in_order():
    out = to_messages({"model": "alias", "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
        {"role": "developer", "content": "answer in French"}, {"role": "user", "content": "how are you"}]},
        default_max_tokens=99, model_map={"alias": "claude-x"}).body
    assert out == {"model": "claude-x", "max_tokens": 99, "system": "be brief\n\nanswer in French",
                   "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                                {"role": "user", "content": "how are you"}]}


def test_sampling_stop_and_user_fields_are_carried():
    out = translate(temperature=0.2, top_p=0.9, stop="END", user="u-1", max_tokens=50, max_completion_tokens=40,
                    stream_options={"include_usage": True}, stream=True)
    assert out["temperature"] == 0.2 and out["top_p"] == 0.9
    assert out["stop_sequences"] == ["END"]
    assert out["metadata"] == {"user_id": "u-1"}
    assert out["max_tokens"] == 40  # the smaller of both limits, as OpenAI applies them
    assert "stream" not in out and "stream_options" not in out and "user" not in out
    assert translate(stop=["a", "b"])["stop_sequences"] == ["a", "b"]
    hinted = translate(safety_identifier="hashed-user", prompt_cache_key="k")
    assert hinted["metadata"] == {"user_id": "hashed-user"} and "prompt_cache_key" not in hinted


def test_fields_at_their_neutral_values_are_accepted():
    out = translate(n=1, logprobs=False, presence_penalty=0, frequency_penalty=0, response_format={"type": "text"},
                    tools=[], seed=None, logit_bias={}, parallel_tool_calls=True, store=False)
    assert set(out) == {"model", "messages", "max_tokens"}


@pytest.mark.parametrize("field, value, param", [
    ("n", 2, "n"), ("logprobs", True, "logprobs"), ("top_logprobs", 2, "top_logprobs"),
    ("functions", [{"name": "f"}], "functions"), ("tool_choice", "required", "tool_choice"),
    ("response_format", {"type": "xml"}, "response_format.type"), ("seed", 7, "seed"), ("audio", {"voice": "x"}, "audio"),
    ("modalities", ["text", "audio"], "modalities"), ("stop", ["END", "\n"], "stop"), ("stop", " ", "stop"),
    ("presence_penalty", 0.5, "presence_penalty"), ("frequency_penalty", 0.1, "frequency_penalty"),
    ("logit_bias", {"50256": -100}, "logit_bias"), ("temperature", 1.5, "temperature"),
    ("invented_field", 1, "invented_field"),
])
def test_fields_the_messages_api_cannot_carry_are_refused_by_name(field, value, param):
    with pytest.raises(UpstreamUnsupported) as info:
        translate(**{field: value})
    exc = info.value
    assert exc.status == 400 and exc.param == param and f"'{param}'" in exc.message
    assert exc.body()["error"]["type"] == "invalid_request_error"
    assert not exc.retryable and exc.caller_fault


@pytest.mark.parametrize("messages, param", [
    ([{"role": "function", "content": "42", "name": "f"}], "messages[0].role"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}],
     "messages[0].content[0].type"),
    ([{"role": "user", "content": "hi", "name": "bob"}], "messages[0].name"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}], "messages[1].content"),
    ([{"role": "user", "content": ""}], "messages[0].content"),
    ([{"role": "system", "content": "only a system prompt"}], "messages"),
])
def test_message_shapes_without_a_translation_are_refused_by_path(messages, param):
    with pytest.raises(UpstreamUnsupported) as info:
        to_messages({"model": "m", "messages": messages}, default_max_tokens=1)
    assert info.value.param == param


@pytest.mark.parametrize("stop_reason, finish_reason", [
    ("end_turn", "stop"), ("stop_sequence", "stop"), ("max_tokens", "length"), ("tool_use", "tool_calls"),
    ("refusal", "content_filter"), ("model_context_window_exceeded", "length"), (None, "stop"), ("new_one", "stop"),
])
def test_a_message_becomes_a_chat_completion_with_its_finish_reason(stop_reason, finish_reason):
    message = {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x",
               "content": [{"type": "text", "text": "Hello"}, {"type": "thinking", "thinking": "hm"},
                           {"type": "text", "text": " there"}],
               "stop_reason": stop_reason, "usage": {"input_tokens": 10, "output_tokens": 3}}
    out = to_completion(message, created=1700)
    assert out["object"] == "chat.completion" and out["created"] == 1700 and out["model"] == "claude-x"
    choice = out["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Hello there", "refusal": None}
    assert choice["finish_reason"] == finish_reason
    assert out["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}


def test_cache_reads_and_writes_count_as_prompt_tokens():
    message = {"type": "message", "content": [], "usage": {"input_tokens": 5, "output_tokens": 2,
                                                           "cache_creation_input_tokens": 7,
                                                           "cache_read_input_tokens": 11}}
    usage = to_completion(message, created=0)["usage"]
    assert usage["prompt_tokens"] == 23 and usage["total_tokens"] == 25
    assert usage["prompt_tokens_details"] == {"cached_tokens": 11}


def test_an_answer_that_is_not_a_message_is_a_bad_response():
    with pytest.raises(UpstreamBadResponse):
        to_completion({"type": "error", "error": {}}, created=0)


STREAM = [
    event("message_start", message={"id": "msg_9", "type": "message", "role": "assistant", "model": "claude-x",
                                    "content": [], "usage": {"input_tokens": 12, "output_tokens": 1}}),
    event("content_block_start", index=0, content_block={"type": "text", "text": ""}),
    event("ping"),
    event("content_block_delta", index=0, delta={"type": "text_delta", "text": "Hel"}),
    event("content_block_delta", index=0, delta={"type": "text_delta", "text": "lo"}),
    event("content_block_stop", index=0),
    event("some_future_event", detail=1),
    event("message_delta", delta={"stop_reason": "max_tokens", "stop_sequence": None}, usage={"output_tokens": 6}),
    event("message_stop"),
]


def run(translator: StreamTranslator, events) -> list:
    out = []
    for raw in events:
        out += translator.feed(raw)
    return out


def decoded(chunks) -> list:
    return [json.loads(c[len(b"data: "):]) for c in chunks if c != DONE]


def test_a_stream_becomes_openai_chunks_ending_in_done():
    translator = StreamTranslator(created=5)
    chunks = run(translator, STREAM)
    assert chunks[-1] == DONE and translator.done
    data = decoded(chunks)
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "msg_9" and c["model"] == "claude-x"
               and c["created"] == 5 and "usage" not in c for c in data)
    deltas = [c["choices"][0]["delta"] for c in data]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "Hel"}, {"content": "lo"}, {}]
    assert [c["choices"][0]["finish_reason"] for c in data] == [None, None, None, "length"]


def test_a_stream_reports_usage_only_when_asked():
    data = decoded(run(StreamTranslator(created=0, include_usage=True), STREAM))
    assert all(c["usage"] is None for c in data[:-1])
    assert data[-1]["choices"] == []
    assert data[-1]["usage"] == {"prompt_tokens": 12, "completion_tokens": 6, "total_tokens": 18}


def test_a_stream_without_message_stop_is_not_done():
    translator = StreamTranslator(created=0)
    run(translator, STREAM[:-1])
    assert not translator.done


def test_an_error_event_raises_the_mapped_error():
    translator = StreamTranslator(created=0)
    run(translator, STREAM[:2])
    with pytest.raises(UpstreamHTTPError) as info:
        translator.feed(event("error", error={"type": "overloaded_error", "message": "Overloaded"}))
    assert info.value.retryable and info.value.status == 503 and info.value.message == "Overloaded"


def test_a_stream_event_that_is_not_json_is_a_bad_response():
    with pytest.raises(UpstreamBadResponse):
        StreamTranslator(created=0).feed(b"event: message_start\ndata: {not json\n\n")


def envelope(kind: str, message: str = "boom") -> dict:
    return {"type": "error", "error": {"type": kind, "message": message}}


def test_overloaded_is_a_retryable_503_with_retry_after():
    exc = to_error(529, envelope("overloaded_error", "Overloaded"), retry_after=None)
    assert exc.retryable and not exc.caller_fault
    assert exc.status == 503 and exc.code == "upstream_overloaded" and exc.upstream_status == 529
    assert exc.retry_after == OVERLOADED_RETRY_AFTER_S and exc.headers() == {"Retry-After": "1"}
    assert to_error(529, envelope("overloaded_error"), retry_after=7.0).retry_after == 7.0


def test_rate_limits_keep_status_and_retry_after():
    exc = to_error(429, envelope("rate_limit_error", "slow down"), retry_after=3.0)
    assert exc.status == 429 and exc.retryable and exc.retry_after == 3.0
    assert exc.body()["error"]["type"] == "rate_limit_error" and exc.message == "slow down"


def test_bad_requests_are_the_callers_fault_with_the_upstream_message():
    exc = to_error(400, envelope("invalid_request_error", "messages: roles must alternate"), retry_after=None)
    assert exc.status == 400 and exc.caller_fault
    assert exc.body()["error"] == {"message": "messages: roles must alternate", "type": "invalid_request_error",
                                   "param": None, "code": "invalid_request_error"}


def test_rejected_credentials_are_the_providers_fault_and_never_echoed():
    exc = to_error(401, envelope("authentication_error", "invalid x-api-key sk-ant-123"), retry_after=None)
    assert exc.status == 502 and exc.retryable and "sk-ant" not in exc.message


def test_server_errors_and_unreadable_bodies_are_retryable_502s():
    assert to_error(500, envelope("api_error"), retry_after=None).status == 502
    exc = to_error(502, None, retry_after=None)
    assert exc.status == 502 and exc.retryable and exc.message == "upstream answered HTTP 502"


def test_streamed_text_is_escaped_like_any_json_string_whatever_the_message_id():
    odd_id = "msg_\x00text\x00\"quoted\""
    translator = StreamTranslator(created=0, include_usage=True)
    translator.feed(event("message_start", message={"id": odd_id, "model": "m", "usage": {}}))
    text = 'say "hi" \u2603\nand \\ more </script>'
    [chunk] = translator.feed(event("content_block_delta", index=0, delta={"type": "text_delta", "text": text}))
    data = decoded([chunk])[0]
    assert data["id"] == odd_id and data["choices"][0]["delta"] == {"content": text} and data["usage"] is None


LONG_SYSTEM = "You are the support assistant of a bicycle shop; answer from the catalogue. " * 60  # ~4,500 chars


def test_a_long_system_prompt_ends_with_a_cache_breakpoint():
    out = translate(messages=[{"role": "system", "content": LONG_SYSTEM}, *USER])
    assert out["system"] == [{"type": "text", "text": LONG_SYSTEM, "cache_control": {"type": "ephemeral"}}]


def test_no_breakpoint_below_the_models_minimum_or_without_a_system_prompt():
    assert translate(messages=[{"role": "system", "content": "be brief"}, *USER])["system"] == "be brief"
    haiku = to_messages({"model": "claude-haiku-4", "messages": [{"role": "system", "content": LONG_SYSTEM}, *USER]},
                        default_max_tokens=9).body
    assert haiku["system"] == LONG_SYSTEM  # Haiku caches from 2,048 tokens
    assert "system" not in translate()


def test_no_breakpoint_is_added_to_a_body_that_holds_four_already():
    from mergebroker.providers.anthropic.translate import with_system_breakpoint

    mark = {"type": "ephemeral"}
    body = {"model": "m", "system": LONG_SYSTEM, "tools": [{"name": f"t{i}", "cache_control": mark} for i in range(4)]}
    assert with_system_breakpoint(body) == body
    three = {**body, "tools": body["tools"][:3]}
    assert with_system_breakpoint(three)["system"][0]["cache_control"] == mark
