"""The simulator's Anthropic mode speaks the Messages API as the official `anthropic` SDK expects it:
answers, streams, stop reasons, usage and typed errors."""

from __future__ import annotations

import aiohttp
import anthropic
import pytest

from mergebroker.providers.simulator.server import answer_for

USER = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
async def client(simulator):
    sdk = anthropic.AsyncAnthropic(base_url=simulator.url.removesuffix("/v1"), api_key="sk-test", max_retries=0)
    try:
        yield sdk
    finally:
        await sdk.close()


async def test_the_sdk_gets_a_message_with_usage(client, simulator):
    message = await client.messages.create(model="claude-x", max_tokens=200, system="Be brief.", messages=USER)
    assert message.type == "message" and message.role == "assistant" and message.model == "claude-x"
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == answer_for(USER[0]["content"])
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0
    assert simulator.stats()["calls"]["messages"] == 1


async def test_the_sdk_streams_text_and_the_final_message(client):
    async with client.messages.stream(model="claude-x", max_tokens=200, messages=USER) as stream:
        pieces = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == answer_for(USER[0]["content"])
    assert final.stop_reason == "end_turn" and final.usage.output_tokens > 1


async def test_stop_sequences_and_max_tokens_end_the_answer_with_their_reason(client):
    answer = answer_for(USER[0]["content"])
    stop = answer.split()[3]
    stopped = await client.messages.create(model="claude-x", max_tokens=200, messages=USER, stop_sequences=[stop])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == answer[: answer.index(stop)]
    cut = await client.messages.create(model="claude-x", max_tokens=3, messages=USER)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3


@pytest.mark.parametrize("override, error", [(429, anthropic.RateLimitError), (529, anthropic.OverloadedError),
                                             (500, anthropic.InternalServerError)])
async def test_injected_faults_arrive_as_the_sdks_typed_errors(client, simulator, override, error):
    simulator.set_faults(status_override=override, retry_after_s=2)
    with pytest.raises(error) as info:
        await client.messages.create(model="claude-x", max_tokens=10, messages=USER)
    assert info.value.body["type"] == "error"
    if override == 429:
        assert info.value.response.headers["retry-after"] == "2"


async def test_invalid_requests_are_refused_as_the_messages_api_does(client):
    # SDK 1.0 dropped the sampling keywords (newer models refuse them); the API still takes them in the body.
    accepted = await client.messages.create(model="claude-x", max_tokens=10, messages=USER,
                                            extra_body={"temperature": 0.5, "top_p": 0.9})
    assert accepted.stop_reason == "max_tokens"
    with pytest.raises(anthropic.BadRequestError, match="temperature"):
        await client.messages.create(model="claude-x", max_tokens=10, messages=USER, extra_body={"temperature": 1.5})
    with pytest.raises(anthropic.BadRequestError, match="frequency_penalty"):
        await client.messages.create(model="claude-x", max_tokens=10, messages=USER,
                                     extra_body={"frequency_penalty": 1})
    with pytest.raises(anthropic.BadRequestError, match="role"):
        await client.messages.create(model="claude-x", max_tokens=10, messages=[{"role": "system", "content": "x"}])


async def test_headers_are_required(simulator):
    url = simulator.url.removesuffix("/v1") + "/v1/messages"
    body = {"model": "claude-x", "max_tokens": 10, "messages": USER}
    async with aiohttp.ClientSession() as http:
        async with http.post(url, json=body, headers={"anthropic-version": "2023-06-01"}) as resp:
            assert resp.status == 401 and (await resp.json())["error"]["type"] == "authentication_error"
        async with http.post(url, json=body, headers={"x-api-key": "k"}) as resp:
            assert resp.status == 400 and "anthropic-version" in (await resp.json())["error"]["message"]
