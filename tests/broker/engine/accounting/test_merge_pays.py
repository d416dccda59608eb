"""Against a provider that bills and caches prompt prefixes, the broker merges only where it pays, and its
own account of the dollars agrees with the provider's bill."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from mergebroker.providers.simulator.faults import SimulatorConfig
from mergebroker.providers.simulator.server import start_simulator
from tests.conftest import provider_for

PRICE = {"input": 2.5, "cached_input": 1.25, "output": 10}  # the simulator's default prices (gpt-4o's)
SYSTEM = " ".join(["Answer questions about the manual of the Nimbus product, plainly and briefly."] * 150)
BATCH = [{"name": "batch", "priority": 0, "window_ms": 60_000, "max_batch": 4, "similarity_threshold": 0.0}]


@pytest.fixture
async def billing_sim():
    sim = await start_simulator(SimulatorConfig(billing="openai", models=("m",)))
    try:
        yield sim
    finally:
        await sim.close()


async def _ask(broker, questions: list[str], system: str | None) -> list[dict]:
    async def one(question: str) -> dict:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
        async with broker.http.post("/v1/chat/completions", json={"model": "m", "messages": messages,
                                                                  "broker": {"tier": "batch"}}) as resp:
            assert resp.status == 200, await resp.text()
            return {"batch": int(resp.headers["X-Broker-Batch-Size"]), **(await resp.json())}

    return await asyncio.gather(*(one(q) for q in questions))


async def _bill(sim) -> dict:
    async with aiohttp.ClientSession() as session, session.get(sim.url + "/_sim/bill") as resp:
        return await resp.json()


async def test_short_questions_without_a_shared_prompt_go_alone_when_tags_would_cost_more(start_broker, billing_sim):
    broker = await start_broker({"providers": [provider_for(billing_sim, models=["m"])], "tiers": BATCH,
                                 "default_tier": "batch", "pricing": {"m": PRICE}, "merge": {"embedder": "none"}})
    answers = await _ask(broker, [f"What is {n} plus {n}?" for n in range(4)], None)
    assert [a["batch"] for a in answers] == [1, 1, 1, 1]
    stats = (await (await broker.http.get("/v1/broker/stats")).json())["cost"]
    assert stats["saved_usd"] == pytest.approx(0, abs=1e-9)


async def test_a_long_shared_prompt_merges_and_the_broker_accounts_the_providers_bill(start_broker, billing_sim):
    broker = await start_broker({"providers": [provider_for(billing_sim, models=["m"])], "tiers": BATCH,
                                 "default_tier": "batch", "pricing": {"m": PRICE}, "merge": {"embedder": "none"}})
    for round_ in range(2):  # the second merged call reads the shared prefix from the provider's cache
        answers = await _ask(broker, [f"Question {round_}.{n}: how do I reset device {n}?" for n in range(4)], SYSTEM)
        assert {a["batch"] for a in answers} == {4}
    bill = await _bill(billing_sim)
    assert bill["requests"] == 2 and bill["cached_tokens"] > 0
    stats = (await (await broker.http.get("/v1/broker/stats")).json())["cost"]
    assert stats["actual_usd"] == pytest.approx(bill["usd"], rel=0.05)
    assert stats["alone_usd"] > stats["actual_usd"] and stats["saved_usd"] > 0


async def test_policy_always_merges_whatever_is_compatible(start_broker, billing_sim):
    broker = await start_broker({"providers": [provider_for(billing_sim, models=["m"])], "tiers": BATCH,
                                 "default_tier": "batch", "pricing": {"m": PRICE},
                                 "merge": {"embedder": "none", "policy": "always"}})
    answers = await _ask(broker, [f"What is {n} plus {n}?" for n in range(4)], None)
    assert {a["batch"] for a in answers} == {4}
