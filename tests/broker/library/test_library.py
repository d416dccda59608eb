"""The in-process library API answers like the HTTP API: same completions, coalescing, merging, errors, stats."""

from __future__ import annotations

import asyncio
import hashlib
import os

import pytest

from mergebroker.broker import Broker
from mergebroker.broker.engine.limits.admission import Caller
from mergebroker.errors import Forbidden, InvalidRequest, Unauthorized
from mergebroker.providers.simulator.server import answer_for
from tests.conftest import provider_for
from tests.helpers.paths import REPO

pytestmark = pytest.mark.timeout(60)

# No timer decides anything here: windows are a minute long, so batches close only when full.
TIERS = [{"name": "standard", "window_ms": 60_000, "max_batch": 4, "similarity_threshold": 0.0},
         {"name": "batch", "priority": 0, "window_ms": 60_000, "max_batch": 4, "similarity_threshold": 0.0}]


def _settings(sim, **extra) -> dict:
    return {"providers": [provider_for(sim)], "merge": {"embedder": "none"}, "tiers": TIERS, **extra}


def _ask(text: str, **extra) -> dict:
    return {"model": "sim-small", "messages": [{"role": "user", "content": text}], **extra}


async def _until(condition) -> None:
    """Yield to the loop until `condition()` holds (callers reach their window within a few loop turns)."""
    for _ in range(10_000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


async def test_chat_returns_the_completion_the_http_api_returns(simulator, start_broker):
    """The same request gets the same chat.completion in-process as over HTTP."""
    http = await start_broker(_settings(simulator))
    status, over_http, _ = await http.chat("What is the capital of France?", broker={"merge": False})
    async with Broker.from_settings(_settings(simulator)) as broker:
        reply = await broker.chat_reply(_ask("What is the capital of France?", broker={"merge": False}))
    assert status == 200
    assert reply.body["object"] == "chat.completion"
    assert reply.body["choices"][0]["message"] == over_http["choices"][0]["message"]
    assert reply.headers["X-Broker-Batch-Size"] == "1" and reply.headers["X-Broker-Cache"] == "miss"
    assert reply.headers["X-Request-ID"].startswith("req_")


async def test_concurrent_callers_in_the_batch_tier_are_merged(simulator):
    """Eight different questions at once in a tier of batches of four take two upstream calls."""
    async with Broker.from_settings(_settings(simulator)) as broker:
        replies = await asyncio.gather(*(broker.chat_reply(_ask(f"Question number {i}?"), caller=Caller("t", "batch"))
                                         for i in range(8)))
        stats = broker.stats()
    assert simulator.stats()["chat_calls"] == 2 and simulator.stats()["merged_calls"] == 2
    assert [r.headers["X-Broker-Batch-Size"] for r in replies] == ["4"] * 8
    assert all(r.body["choices"][0]["message"]["content"] for r in replies)
    assert stats["tiers"]["batch"]["merge_rate"] == 1.0 and stats["tiers"]["batch"]["mean_batch_size"] == 4.0
    assert stats["tiers"]["batch"]["queue_depth"] == 0


async def test_identical_chats_share_one_call_within_a_tenant_only(simulator):
    """Identical concurrent requests of one tenant share one upstream call; another tenant's are its own."""
    body = _ask("Summarise the water cycle.", temperature=0, broker={"merge": False})
    async with Broker.from_settings(_settings(simulator)) as broker:
        replies = await asyncio.gather(*(broker.chat_reply(body, caller=Caller(tenant, "standard"))
                                         for tenant in ["a"] * 5 + ["b"] * 5))
        stats = broker.stats()
    assert simulator.stats()["chat_calls"] == 2
    assert sorted(r.headers["X-Broker-Cache"] for r in replies).count("miss") == 2
    shared = stats["chat_cache"]["hit"] + stats["chat_cache"]["coalesced"]
    assert shared == 8 and stats["chat_cache"]["hit_rate"] + stats["chat_cache"]["coalesced_ratio"] == 0.8


async def test_many_callers_of_one_text_share_one_embedding(simulator):
    """Fifty concurrent callers of one text cost one upstream embedding of one text."""
    async with Broker.from_settings(_settings(simulator, embeddings={"window_ms": 60_000, "max_batch_size": 1})) as b:
        vectors = await asyncio.gather(*(b.embed("the same text", model="sim-embed") for _ in range(50)))
        stats = b.stats()["embeddings"]
    assert simulator.stats()["embedding_calls"] == 1
    assert all(v == vectors[0] for v in vectors) and len(vectors[0]) == 1
    assert stats["texts"] == 50 and stats["cached"] + stats["coalesced"] == 49
    assert stats["batches"] == 1 and stats["mean_batch_size"] == 1.0


async def test_the_coalescers_four_figures(simulator):
    """Cache-hit rate, coalesced ratio, mean batch size and pending-window count, step by step."""
    settings = _settings(simulator, embeddings={"window_ms": 60_000, "max_batch_size": 4})
    async with Broker.from_settings(settings) as b:
        waiting = [asyncio.ensure_future(b.embed(["alpha"], model="sim-embed")) for _ in range(3)]
        waiting.append(asyncio.ensure_future(b.embed(["beta"], model="sim-embed")))
        await _until(lambda: b.stats()["embeddings"]["waiting"] == 4)
        middle = b.stats()["embeddings"]
        await b.embed(["gamma", "delta"], model="sim-embed")  # the fourth distinct text closes the window
        first = await asyncio.gather(*waiting)
        again = await b.embed(["alpha"], model="sim-embed")
        end = b.stats()["embeddings"]
    assert (middle["pending_window"], middle["in_flight"], middle["texts"]) == (2, 2, 0)
    assert simulator.stats()["embedding_calls"] == 1 and again == first[0]
    assert (end["texts"], end["cached"], end["coalesced"]) == (7, 1, 2)
    assert end["cache_hit_rate"] == pytest.approx(1 / 7) and end["coalesced_ratio"] == pytest.approx(2 / 7)
    assert end["mean_batch_size"] == 4.0 and end["pending_window"] == 0 and end["waiting"] == 0


async def test_errors_are_the_http_apis_errors(simulator):
    """Bad bodies, unknown tiers, unknown models and missing keys raise the errors HTTP would send."""
    key = "sk-test-library"
    settings = _settings(simulator, auth={"mode": "keys", "keys": [
        {"sha256": hashlib.sha256(key.encode()).hexdigest(), "tenant": "acme", "tiers": ["standard", "batch"]}]})
    async with Broker.from_settings(settings) as broker:
        with pytest.raises(InvalidRequest) as bad:
            await broker.chat({"model": "sim-small", "messages": []}, caller=Caller("acme", "standard"))
        with pytest.raises(Forbidden):
            await broker.chat(_ask("hi"), caller=Caller("acme", "no-such-tier"))
        with pytest.raises(Unauthorized):
            await broker.chat(_ask("hi"))
        reply = await broker.chat_reply(_ask("hi", broker={"merge": False}),
                                        caller={"Authorization": f"Bearer {key}", "X-Broker-Tier": "batch"})
        requests = broker.engine.metrics.registry.get_sample_value(
            "mergebroker_requests_total", {"endpoint": "chat", "tier": "", "status": "400"})
    assert bad.value.status == 400 and bad.value.param == "messages"
    assert reply.body["choices"][0]["finish_reason"] == "stop"
    assert requests == 1.0


async def test_a_broker_is_used_inside_async_with_only(simulator):
    """Calls outside `async with` say how to start the broker instead of failing obscurely."""
    broker = Broker.from_settings(_settings(simulator))
    with pytest.raises(RuntimeError, match="async with"):
        await broker.chat(_ask("hi"))


@pytest.mark.model
def test_the_readme_library_example_runs_as_written(tmp_path):
    """The README's library example, run as a script, prints a merged answer, 384 dimensions and its stats."""
    import re
    import subprocess
    import sys

    readme = (REPO / "README.md").read_text()
    example = re.search(r"<!-- library-example -->\n```python\n(.*?)```", readme, re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(example)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MERGEBROKER_")}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=110,
                         env={**env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert lines[-2] == "384 dimensions"
    assert lines[-1] == "merge rate 1.0 coalesced ratio 0.9"


async def test_a_stream_comes_chunk_by_chunk_and_is_accounted_like_http(simulator):
    """`chat_stream` yields the chunks HTTP would stream, text and usage included, and counts the request."""
    async with Broker.from_settings(_settings(simulator)) as broker:
        chunks = [chunk async for chunk in broker.chat_stream(
            _ask("Tell me about rivers", stream_options={"include_usage": True}, broker={"merge": False}))]
        requests = broker.engine.metrics.registry.get_sample_value(
            "mergebroker_requests_total", {"endpoint": "chat", "tier": "standard", "status": "200"})
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    assert text == answer_for("Tell me about rivers")
    assert chunks[-1]["usage"]["completion_tokens"] > 0 and requests == 1.0


async def test_responses_and_messages_answer_in_process(simulator):
    """The Responses and Messages APIs in process: the objects HTTP would answer, whole."""
    async with Broker.from_settings(_settings(simulator)) as broker:
        response = await broker.responses({"model": "sim-small", "input": "What is the capital of France?",
                                           "broker": {"merge": False}})
        message = await broker.messages({"model": "sim-small", "max_tokens": 100, "broker": {"merge": False},
                                         "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        with pytest.raises(InvalidRequest):
            await broker.messages({"model": "sim-small", "messages": [{"role": "user", "content": "hi"}]})
    assert response["output"][0]["content"][0]["text"] == answer_for("What is the capital of France?")
    assert message["content"][0]["text"] == answer_for("What is the capital of France?")
    assert message["type"] == "message" and message["usage"]["output_tokens"] > 0
