"""Every request is accounted with the usage it really had, whichever path it took: plain, streamed (with or
without the caller asking for usage), merged, released early, merged stream, coalesced, cached; a stream
whose provider reports no usage is ledgered with the broker's count, marked as counted."""

from __future__ import annotations

import asyncio
import json
import sqlite3

import pytest

from mergebroker.clock import FakeClock
from tests.broker.engine.limits.test_tiers_api import SubmitSpy
from tests.conftest import provider_for
from tests.helpers.polling import wait_until

WINDOW_S = 0.2
COLUMNS = "endpoint, cache, batch_size, prompt_tokens, completion_tokens, usage_counted"


def config(sim, path, *, early_release: bool = True) -> dict:
    return {"providers": [provider_for(sim, early_release=early_release)], "merge": {"embedder": "none"},
            "ledger": {"path": str(path), "flush_interval_s": 0.05},
            "tiers": [{"name": "standard", "merge": False},
                      {"name": "batch", "window_ms": WINDOW_S * 1000, "max_batch": 2, "similarity_threshold": 0.0,
                       "window_policy": "fixed"}], "default_tier": "standard"}


async def rows(broker, path, count: int) -> list[dict]:
    """The ledger's rows once `count` are written: a stream's record waits for its usage, which settles on the
    broker's own loop once the stream ends."""
    async def written() -> list[tuple] | None:
        await broker.broker.ledger.flush()
        found = sqlite3.connect(path).execute(f"SELECT {COLUMNS} FROM ledger ORDER BY ts").fetchall()
        return found if len(found) >= count else None

    # interval 0: the broker's tasks run on this same loop, so each look only yields to them
    found = await wait_until(written, 10, f"fewer than {count} ledger rows written", interval_s=0)
    return [dict(zip(COLUMNS.split(", "), row)) for row in found]


async def stream(broker, question: str, *, include_usage: bool, tier: str = "standard") -> list[dict]:
    body = {"model": "sim-small", "stream": True, "messages": [{"role": "user", "content": question}]}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    async with broker.http.post("/v1/chat/completions", json=body, headers={"X-Broker-Tier": tier}) as resp:
        raw = (await resp.read()).decode()
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def tokens(row: dict) -> tuple[int, int]:
    return row["prompt_tokens"], row["completion_tokens"]


async def merged(broker, clock: FakeClock, requests: list) -> list:
    """Start both members, each queued before the other, then close the window."""
    spy = SubmitSpy(broker)
    tasks = []
    for n, request in enumerate(requests, 1):
        tasks.append(asyncio.create_task(request()))
        await spy.wait_for(n)
    clock.advance(WINDOW_S)
    return await asyncio.gather(*tasks)


@pytest.mark.parametrize("include_usage", [True, False])
async def test_a_plain_stream_is_ledgered_with_the_providers_usage(simulator, start_broker, tmp_path, include_usage):
    broker = await start_broker(config(simulator, tmp_path / "l.sqlite3"))
    events = await stream(broker, "How do tides work?", include_usage=include_usage)
    [row] = await rows(broker, tmp_path / "l.sqlite3", 1)
    stats = simulator.stats()
    assert tokens(row) == (stats["prompt_tokens"], stats["completion_tokens"]) and row["completion_tokens"] > 0
    assert row["usage_counted"] == 0 and row["endpoint"] == "chat"
    usage_chunks = [e["usage"] for e in events if e.get("usage")]
    assert usage_chunks == ([{"prompt_tokens": row["prompt_tokens"], "completion_tokens": row["completion_tokens"],
                              "total_tokens": sum(tokens(row))}] if include_usage else [])
    assert simulator.last_request_body()["stream_options"] == {"include_usage": True}  # asked for upstream


async def test_a_stream_whose_provider_reports_no_usage_is_ledgered_as_counted(simulator, start_broker, tmp_path):
    simulator.set_faults(reject_stream_options=True)
    broker = await start_broker(config(simulator, tmp_path / "l.sqlite3"))
    events = await stream(broker, "How do tides work?", include_usage=False)
    [row] = await rows(broker, tmp_path / "l.sqlite3", 1)
    assert row["usage_counted"] == 1 and row["prompt_tokens"] > 0
    assert row["completion_tokens"] == simulator.stats()["completion_tokens"] > 0  # the same tokenizer counts
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])


async def test_merged_streams_are_ledgered_with_their_share_of_the_merged_call(simulator, start_broker, tmp_path):
    clock = FakeClock()
    broker = await start_broker(config(simulator, tmp_path / "l.sqlite3"), clock=clock)
    await merged(broker, clock, [lambda: stream(broker, "Why is the sky blue?", include_usage=True, tier="batch"),
                                 lambda: stream(broker, "How do cats purr?", include_usage=False, tier="batch")])
    found = await rows(broker, tmp_path / "l.sqlite3", 2)
    stats = simulator.stats()
    assert stats["merged_calls"] == 1 and [r["batch_size"] for r in found] == [2, 2]
    assert sum(r["prompt_tokens"] for r in found) == stats["prompt_tokens"]
    assert sum(r["completion_tokens"] for r in found) == stats["completion_tokens"]
    assert all(r["completion_tokens"] > 0 and r["usage_counted"] == 0 for r in found)


@pytest.mark.parametrize("early_release", [True, False])
async def test_merged_members_are_ledgered_with_their_share_of_the_merged_call(simulator, start_broker, tmp_path,
                                                                               early_release):
    clock = FakeClock()
    broker = await start_broker(config(simulator, tmp_path / "l.sqlite3", early_release=early_release), clock=clock)
    batch = {"X-Broker-Tier": "batch"}
    answers = await merged(broker, clock, [lambda: broker.chat("Why is the sky blue?", headers=batch),
                                           lambda: broker.chat("How do cats purr?", headers=batch)])
    found = await rows(broker, tmp_path / "l.sqlite3", 2)
    stats = simulator.stats()
    assert [h["X-Broker-Batch-Size"] for _, _, h in answers] == ["2", "2"]
    assert sum(r["prompt_tokens"] for r in found) == stats["prompt_tokens"]
    assert sum(r["completion_tokens"] for r in found) == stats["completion_tokens"]


async def test_coalesced_and_cached_requests_are_ledgered_without_tokens_of_their_own(simulator, start_broker,
                                                                                     tmp_path):
    broker = await start_broker(config(simulator, tmp_path / "l.sqlite3"))
    plain = await asyncio.gather(*(broker.chat("Same question", temperature=0) for _ in range(2)))
    assert sorted(h["X-Broker-Cache"] for _, _, h in plain) == ["coalesced", "miss"]
    _, _, hit = await broker.chat("Same question", temperature=0)
    assert hit["X-Broker-Cache"] == "hit"
    found = {r["cache"]: r for r in await rows(broker, tmp_path / "l.sqlite3", 3)}
    stats = simulator.stats()
    assert tokens(found["miss"]) == (stats["prompt_tokens"], stats["completion_tokens"])
    assert tokens(found["coalesced"]) == tokens(found["hit"]) == (0, 0)
