"""The broker speaks the OpenAI HTTP API end to end against the simulated upstream."""

from __future__ import annotations

import pytest

from mergebroker.clock import FakeClock
from mergebroker.providers.simulator.server import answer_for
from tests.conftest import provider_for

PASSTHROUGH = {"merge": {"enabled": False}}


async def test_chat_completion_through_the_openai_sdk_returns_the_upstream_answer(simulator, start_broker):
    broker = await start_broker({"providers": [provider_for(simulator)], **PASSTHROUGH})
    reply = await broker.openai.chat.completions.create(
        model="sim-small", messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert reply.choices[0].message.content == answer_for("What is the capital of France?")
    assert reply.usage.prompt_tokens > 0
    assert simulator.stats()["chat_calls"] == 1


async def test_streaming_relays_chunks_and_done_with_usage(simulator, start_broker):
    broker = await start_broker({"providers": [provider_for(simulator)], **PASSTHROUGH})
    stream = await broker.openai.chat.completions.create(
        model="sim-small", messages=[{"role": "user", "content": "Tell me about rivers"}], stream=True,
        stream_options={"include_usage": True})
    text, usage = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    assert text == answer_for("Tell me about rivers")
    assert usage is not None and usage.completion_tokens > 0


async def test_embeddings_and_models_answer_in_openai_shape(simulator, start_broker):
    broker = await start_broker({"providers": [provider_for(simulator, models=["sim-small", "sim-embed"])],
                                 **PASSTHROUGH})
    result = await broker.openai.embeddings.create(model="sim-embed", input=["alpha", "beta"])
    assert [d.index for d in result.data] == [0, 1]
    assert len(result.data[0].embedding) == 384
    models = await broker.openai.models.list()
    assert {"sim-small", "sim-embed"} <= {m.id for m in models.data}


async def test_models_list_asks_the_upstream_once_per_minute(simulator, start_broker):
    broker = await start_broker({"providers": [provider_for(simulator)], **PASSTHROUGH})
    for _ in range(3):
        async with broker.http.get("/v1/models") as resp:
            assert resp.status == 200
            assert "sim-small" in {m["id"] for m in (await resp.json())["data"]}
    assert simulator.stats()["calls"].get("models", 0) == 1


async def test_the_upstream_model_list_is_fetched_again_after_its_ttl():
    from mergebroker.broker.http.routes import UpstreamModels

    calls = []

    async def fetch() -> list[str]:
        calls.append(1)
        return [f"model-{len(calls)}"]

    clock = FakeClock()
    models = UpstreamModels(ttl_s=60, clock=clock)
    assert await models.get(fetch) == ["model-1"]
    clock.advance(59)
    assert await models.get(fetch) == ["model-1"]
    clock.advance(2)
    assert await models.get(fetch) == ["model-2"]


async def test_models_list_needs_credentials_like_the_other_routes(simulator, start_broker):
    import hashlib

    key = hashlib.sha256(b"good-key").hexdigest()
    broker = await start_broker({"providers": [provider_for(simulator, models=["sim-small"])], **PASSTHROUGH,
                                 "auth": {"mode": "keys", "keys": [{"sha256": key, "tenant": "a"}]}})
    async with broker.http.get("/v1/models") as resp:
        assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_api_key"
    async with broker.http.get("/v1/models", headers={"Authorization": "Bearer good-key"}) as resp:
        assert resp.status == 200 and [m["id"] for m in (await resp.json())["data"]] == ["sim-small"]


async def test_absurdly_nested_json_is_400_invalid_json(simulator, start_broker):
    broker = await start_broker({"providers": [provider_for(simulator)], **PASSTHROUGH})
    for path in ("/v1/chat/completions", "/v1/embeddings"):
        async with broker.http.post(path, data="[" * 100_000, headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_json"


async def test_request_id_is_echoed_and_generated(simulator, start_broker):
    broker = await start_broker({"providers": [provider_for(simulator)], **PASSTHROUGH})
    status, _, headers = await broker.chat("hello there", headers={"X-Request-ID": "abc-123"})
    assert status == 200 and headers["X-Request-ID"] == "abc-123"
    assert headers["X-Broker-Batch-Size"] == "1" and headers["X-Broker-Cache"] == "miss"
    assert float(headers["X-Broker-Overhead-Ms"]) >= 0
    status, _, headers = await broker.chat("hello again")
    assert headers["X-Request-ID"].startswith("req_")


BAD_INPUTS = [
    ("not json", "application/json", 400, None),
    ('{"model": "sim-small"}', "application/json", 400, "messages"),
    ('{"model": "sim-small", "messages": "hi"}', "application/json", 400, "messages"),
    ('{"model": "sim-small", "messages": [{"role": "user", "content": []}]}', "application/json", 400,
     "messages.0.content"),
    ('{"model": "sim-small", "messages": [{"role": "wizard", "content": "hi"}]}', "application/json", 400,
     "messages.0.role"),
    ('{"model": "sim-small", "messages": [{"role": "user", "content": "hi"}], "n": 0}', "application/json", 400, "n"),
    ('{"model": "sim-small", "messages": [{"role": "user", "content": "hi"}], "temperature": 7}',
     "application/json", 400, "temperature"),
    ('[1, 2]', "application/json", 400, None),
    ('{"model": "sim-small", "messages": [{"role": "user", "content": "hi"}]}', "text/plain", 415, None),
    ('{"model": "nope", "messages": [{"role": "user", "content": "hi"}]}', "application/json", 404, "model"),
]


@pytest.mark.parametrize("raw,content_type,status,param", BAD_INPUTS)
async def test_bad_input_gets_an_openai_error_envelope(simulator, start_broker, raw, content_type, status, param):
    broker = await start_broker({"providers": [provider_for(simulator, models=["sim-small"])], **PASSTHROUGH})
    async with broker.http.post("/v1/chat/completions", data=raw, headers={"Content-Type": content_type}) as resp:
        body = await resp.json()
    assert resp.status == status
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if param:
        assert body["error"]["param"] == param
    assert simulator.stats()["chat_calls"] == 0


async def test_unknown_route_wrong_method_and_oversized_body(simulator, start_broker):
    broker = await start_broker({"providers": [provider_for(simulator)], "server": {"max_body_bytes": 2000},
                                 **PASSTHROUGH})
    async with broker.http.get("/v1/nothing") as resp:
        assert resp.status == 404 and (await resp.json())["error"]["type"] == "invalid_request_error"
    async with broker.http.get("/v1/chat/completions") as resp:
        assert resp.status == 405 and "error" in await resp.json()
    big = {"model": "sim-small", "messages": [{"role": "user", "content": "x" * 5000}]}
    async with broker.http.post("/v1/chat/completions", json=big) as resp:
        assert resp.status == 413 and "error" in await resp.json()


async def test_unknown_fields_are_forwarded_and_broker_fields_are_not(simulator, start_broker):
    broker = await start_broker({"providers": [provider_for(simulator)], **PASSTHROUGH})
    status, body, _ = await broker.chat("forward me", custom_vendor_flag=True, broker={"timeout_s": 5})
    assert status == 200
    seen = simulator.last_request_body()
    assert seen["custom_vendor_flag"] is True and "broker" not in seen


async def test_retries_429_and_503_then_succeeds(simulator, start_broker):
    broker = await start_broker({"providers": [provider_for(simulator)], **PASSTHROUGH,
                                 "retry": {"attempts": 3, "backoff_base_s": 0.01, "backoff_max_s": 0.02}})
    simulator.set_faults(fail_first_n=2)
    status, body, _ = await broker.chat("survive two failures")
    assert status == 200 and body["choices"][0]["message"]["content"] == answer_for("survive two failures")
    assert simulator.stats()["chat_calls"] == 3


async def test_persistent_429_is_returned_with_retry_after(simulator, start_broker):
    broker = await start_broker({"providers": [provider_for(simulator)], **PASSTHROUGH,
                                 "retry": {"attempts": 2, "backoff_base_s": 0.01, "max_retry_after_s": 0.5}})
    simulator.set_faults(rate_429=1.0, retry_after_s=1)
    status, body, headers = await broker.chat("always limited")
    assert status == 429 and headers["Retry-After"] == "1"
    assert body["error"]["type"] == "rate_limit_error"


async def test_failover_to_second_upstream_when_first_is_down(simulator, start_broker):
    from tests.conftest import free_port

    dead = {"name": "dead", "base_url": f"http://127.0.0.1:{free_port()}/v1"}
    broker = await start_broker({"providers": [dead, provider_for(simulator)], "routing": "round_robin",
                                 **PASSTHROUGH, "retry": {"attempts": 1}})
    for i in range(4):
        status, body, _ = await broker.chat(f"question {i}")
        assert status == 200 and body["choices"][0]["message"]["content"] == answer_for(f"question {i}")


async def test_deadline_exceeded_gives_504(simulator, start_broker):
    broker = await start_broker({"providers": [provider_for(simulator)], **PASSTHROUGH, "retry": {"attempts": 1}})
    simulator.set_faults(timeout_rate=1.0, hang_s=5)
    status, body, _ = await broker.chat("slow one", broker={"timeout_s": 0.3})
    assert status == 504 and body["error"]["type"] == "timeout_error"
    assert body["error"]["code"] == "deadline_exceeded"  # the caller's deadline, not a slow upstream


async def test_a_stream_with_usage_settles_the_token_limit_to_what_it_used(simulator, start_broker):
    tiers = [{"name": "standard", "window_ms": 0, "tpm": 100_000}]
    # A fake clock: the bucket must not refill between the two requests.
    broker = await start_broker({"providers": [provider_for(simulator)], "tiers": tiers, **PASSTHROUGH},
                                clock=FakeClock())
    body = {"model": "sim-small", "messages": [{"role": "user", "content": "stream and count"}], "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": 5000}
    async with broker.http.post("/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        raw = await resp.read()
    used = simulator.stats()["prompt_tokens"] + simulator.stats()["completion_tokens"]
    assert b"[DONE]" in raw
    _, _, headers = await broker.chat("next one", max_tokens=10)
    next_reserved = int(headers["x-ratelimit-limit-tokens"]) - int(headers["x-ratelimit-remaining-tokens"]) - used
    assert 0 < next_reserved < 100  # the stream's 5000-token reservation was given back down to its usage
