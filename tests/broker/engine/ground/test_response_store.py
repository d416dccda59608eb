"""Stored Responses API responses, in SQLite and in Redis: per tenant, chained, expiring, and shared by the
replicas of a cluster through Redis."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from mergebroker.broker.engine.ground.response_store import (
    RedisResponseStore,
    SqliteResponseStore,
    chain_history,
    open_response_store,
)
from mergebroker.merge.redis_cache import make_redis_client
from tests.broker.engine.inbound.test_responses_api import TIERS, WEATHER
from tests.conftest import provider_for


def response(rid: str, text: str) -> dict[str, Any]:
    return {"id": rid, "object": "response", "output": [{"type": "message", "role": "assistant",
                                                         "content": [{"type": "output_text", "text": text}]}]}


def asked(text: str) -> list[dict[str, Any]]:
    return [{"type": "message", "role": "user", "content": text}]


@pytest.fixture(params=["sqlite", "redis"])
async def store(request, tmp_path) -> AsyncIterator[Any]:
    if request.param == "sqlite":
        kept = SqliteResponseStore(str(tmp_path / "responses.sqlite3"))
        yield kept
        await kept.close()
        return
    server = request.getfixturevalue("redis_server")
    client = make_redis_client(server.url)
    kept = RedisResponseStore(client, retention_s=3600)
    yield kept
    await kept.close()
    await client.aclose()


async def test_a_chain_is_rebuilt_oldest_first_and_only_for_its_tenant(store) -> None:
    store.keep("a", response("resp_1", "one"), asked("first"), None)
    store.keep("a", response("resp_2", "two"), asked("second"), "resp_1")  # read at once: no wait in between
    items = await chain_history(store, "a", "resp_2")
    assert [i.get("content") if i["role"] == "user" else i["content"][0]["text"] for i in items] == [
        "first", "one", "second", "two"]
    assert await chain_history(store, "b", "resp_2") is None and await store.get("b", "resp_1") is None
    assert await store.delete("b", "resp_1") is False and await store.delete("a", "resp_1") is True
    assert await chain_history(store, "a", "resp_2") == items[2:]  # an ancestor gone: kept from where it is


async def test_sqlite_rows_expire_after_the_retention(tmp_path) -> None:
    now = [1000.0]
    store = SqliteResponseStore(None, retention_s=60, wall_clock=lambda: now[0])
    store.keep("a", response("resp_1", "one"), asked("q"), None)
    now[0] += 61
    assert await store.get("a", "resp_1") is None
    await store.close()


async def test_redis_rows_carry_the_retention_as_their_ttl(redis_server) -> None:
    client = make_redis_client(redis_server.url)
    store = RedisResponseStore(client, retention_s=120)
    store.keep("a", response("resp_1", "one"), asked("q"), None)
    assert (await store.get("a", "resp_1")) is not None
    ttl_ms = await client.pttl("mb:responses:a:resp_1")
    await store.close()
    await client.aclose()
    assert 110_000 < ttl_ms <= 120_000


def test_the_backend_is_redis_in_cluster_mode_and_sqlite_otherwise() -> None:
    redis = object()
    assert isinstance(open_response_store("auto", path=None, retention_s=1, redis=redis, cluster=True),
                      RedisResponseStore)
    assert isinstance(open_response_store("auto", path=None, retention_s=1, redis=redis, cluster=False),
                      SqliteResponseStore)
    assert isinstance(open_response_store("redis", path=None, retention_s=1, redis=redis, cluster=False),
                      RedisResponseStore)


async def test_replicas_sharing_redis_continue_each_others_chains(simulator, start_broker, redis_server) -> None:
    config = {"providers": [provider_for(simulator)], "tiers": TIERS, "merge": {"embedder": "none"},
              "redis": {"url": redis_server.url}, "responses": {"backend": "redis"}}
    one, two = await start_broker(config), await start_broker(config)
    first = await one.openai.responses.create(model="sim-small", input="What is the weather in Oslo?",
                                              tools=[WEATHER])
    call = next(item for item in first.output if item.type == "function_call")
    second = await two.openai.responses.create(
        model="sim-small", previous_response_id=first.id, tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    assert "sunny, 21 C" in second.output_text
    assert (await one.openai.responses.retrieve(second.id)).output_text == second.output_text
