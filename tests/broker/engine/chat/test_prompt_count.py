"""A request's prompt is counted (tokenized) only where something reads the count: a token limit, merge planning,
the ledger or a price. A lone request where nothing does is sent without it, which is most of a lone request's
own work; wherever the count is read, it is the same count as before."""

from __future__ import annotations

import asyncio
import sqlite3
import uuid

from mergebroker.broker.engine.ground import tokens
from tests.conftest import provider_for
from tests.helpers.polling import wait_until


def counted_texts(monkeypatch) -> list[str]:
    """The texts the broker's tokenizer is asked to encode from now on."""
    encode = tokens._encoder()
    assert encode is not None
    seen: list[str] = []
    monkeypatch.setattr(tokens, "_encode", lambda text: seen.append(text) or encode(text))
    return seen


async def test_a_lone_request_that_nothing_limits_or_prices_is_sent_without_counting_its_prompt(
        simulator, start_broker, monkeypatch):
    broker = await start_broker({"providers": [provider_for(simulator)], "merge": {"embedder": "none"}})
    seen = counted_texts(monkeypatch)
    question = f"How many legs has a spider? ({uuid.uuid4().hex})"
    status, body, headers = await broker.chat(question, system=f"You answer zoology, case {uuid.uuid4().hex}.")
    assert status == 200 and body["choices"][0]["message"]["content"] and headers["X-Broker-Batch-Size"] == "1"
    assert question not in seen


async def test_a_token_limit_counts_the_prompt_at_admission(simulator, start_broker, monkeypatch):
    broker = await start_broker({"providers": [provider_for(simulator)], "merge": {"embedder": "none"},
                                 "tiers": [{"name": "metered", "tpm": 100_000}], "default_tier": "metered"})
    seen = counted_texts(monkeypatch)
    question = f"How many legs has an ant? ({uuid.uuid4().hex})"
    status, _, _ = await broker.chat(question)
    assert status == 200 and seen.count(question) == 1


async def test_the_ledger_reads_the_same_count_for_lone_coalesced_and_cached_requests(simulator, start_broker,
                                                                                     tmp_path):
    path = tmp_path / "ledger.sqlite3"
    broker = await start_broker({"providers": [provider_for(simulator)], "merge": {"embedder": "none"},
                                 "ledger": {"path": str(path), "flush_interval_s": 0.05}})
    question = f"How many legs has a crab? ({uuid.uuid4().hex})"
    answers = await asyncio.gather(*(broker.chat(question, temperature=0) for _ in range(2)))
    assert sorted(h["X-Broker-Cache"] for _, _, h in answers) == ["coalesced", "miss"]
    _, _, hit = await broker.chat(question, temperature=0)
    assert hit["X-Broker-Cache"] == "hit"

    async def written() -> list[tuple] | None:
        await broker.broker.ledger.flush()
        found = sqlite3.connect(path).execute("SELECT cache, alone_prompt_tokens FROM ledger").fetchall()
        return found if len(found) >= 3 else None

    found = dict(await wait_until(written, 10, "fewer than 3 ledger rows written", interval_s=0))
    expected = tokens.estimate_prompt_tokens([{"role": "user", "content": question}])
    assert found == {"miss": expected, "coalesced": expected, "hit": expected}
