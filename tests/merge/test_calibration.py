"""The broker learns how a provider counts tokens from every call it sends, merged ones included, so the
bill it says a request would have cost alone matches the provider's even where the provider's tokenizer
is not the broker's."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from mergebroker.merge.calibration import Calibration, CallTokens
from mergebroker.providers.simulator.faults import SimulatorConfig
from mergebroker.providers.simulator.server import start_simulator
from tests.conftest import provider_for

PRICE = {"input": 2.5, "cached_input": 1.25, "output": 10}  # the simulator's default prices
SYSTEM = " ".join(["Answer questions about the manual of the Nimbus product, plainly and briefly."] * 150)
BATCH = [{"name": "batch", "priority": 0, "window_ms": 60_000, "max_batch": 4, "similarity_threshold": 0.0}]


def test_the_first_sample_sets_the_ratio_and_later_ones_move_it_by_alpha():
    calibration = Calibration(alpha=0.5)
    assert calibration.ratio("azure", "gpt-4o") == 1.0 and calibration.samples("azure", "gpt-4o") == 0
    assert calibration.update("azure", "gpt-4o", reported=70, counted=100) == pytest.approx(0.7)
    assert calibration.update("azure", "gpt-4o", reported=90, counted=100) == pytest.approx(0.8)
    assert calibration.scale("azure", "gpt-4o", 1000) == 800
    assert calibration.samples("azure", "gpt-4o") == 2


def test_outliers_are_clamped_and_empty_counts_ignored():
    calibration = Calibration(alpha=1.0)
    assert calibration.update("p", "m", reported=1000, counted=10) == 2.0
    assert calibration.update("p", "m", reported=1, counted=1000) == 0.5
    assert calibration.update("q", "m", reported=0, counted=100) == pytest.approx(0.5)  # q has none: p's
    assert calibration.samples("q", "m") == 2  # what its ratio rests on: the model's samples


def test_prompt_and_completion_are_learnt_apart_and_a_provider_without_samples_takes_the_models():
    calibration = Calibration()
    calibration.observe_call("anthropic", "claude", CallTokens(counted_prompt=1000, reported_prompt=1300,
                                                               counted_completion=100, reported_completion=120))
    assert calibration.ratio("anthropic", "claude", "prompt") == pytest.approx(1.3)
    assert calibration.ratio("anthropic", "claude", "completion") == pytest.approx(1.2)
    assert calibration.ratio("", "claude", "prompt") == pytest.approx(1.3)  # a cache hit names no provider
    assert calibration.learnt("other") is None and calibration.ratio("anthropic", "other") == 1.0
    assert calibration.as_dict()["anthropic/claude"]["completion"] == {"ratio": 1.2, "samples": 1}


@pytest.fixture(params=[0.7, 1.3], ids=["counts-30%-fewer", "counts-30%-more"])
async def other_tokenizer(request):
    sim = await start_simulator(SimulatorConfig(billing="openai", models=("m",), token_scale=request.param))
    try:
        yield sim
    finally:
        await sim.close()


async def _ask(url: str, questions: list[str], *, headers: dict[str, str], broker: bool) -> list[dict]:
    async def one(session: aiohttp.ClientSession, question: str) -> dict:
        body = {"model": "m", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                "max_tokens": 60, "temperature": 0, **({"broker": {"tier": "batch"}} if broker else {})}
        async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            return {"batch": resp.headers.get("X-Broker-Batch-Size"), **(await resp.json())}

    async with aiohttp.ClientSession() as session:
        return list(await asyncio.gather(*(one(session, q) for q in questions)))


async def _bill(sim, *, reset: bool = False) -> dict:
    async with aiohttp.ClientSession() as session:
        async with session.get(sim.url + "/_sim/bill") as resp:
            bill = await resp.json()
        if reset:
            async with session.post(sim.url + "/_sim/bill/reset", json={}) as resp:
                assert resp.status == 200
        return bill


async def test_merged_calls_teach_the_scale_and_the_alone_bill_matches_the_direct_one(start_broker, other_tokenizer):
    """Every call merged (none alone to learn from): before, the alone bill was the broker's own count, 30%
    off; now each merged call's counts calibrate it."""
    questions = [f"Question {r}.{n}: how do I reset device {n}?" for r in range(3) for n in range(4)]
    for round_ in range(3):  # sent direct, in the same rounds the broker will merge
        await _ask(other_tokenizer.url.removesuffix("/v1"), questions[4 * round_:4 * round_ + 4], headers={"Authorization": "Bearer k"},
                   broker=False)
    direct = await _bill(other_tokenizer, reset=True)
    broker = await start_broker({"providers": [provider_for(other_tokenizer, models=["m"])], "tiers": BATCH,
                                 "default_tier": "batch", "pricing": {"m": PRICE}, "merge": {"embedder": "none"}})
    for round_ in range(3):
        answers = await _ask(broker.url, questions[4 * round_:4 * round_ + 4],
                             headers={}, broker=True)
        assert {a["batch"] for a in answers} == {"4"}
    through = await _bill(other_tokenizer)
    assert through["requests"] == 3
    cost = (await (await broker.http.get("/v1/broker/stats")).json())["cost"]
    assert cost["calibrated"] is True and cost["uncalibrated_requests"] == 0
    learnt = cost["calibration"]
    (ratios,) = learnt.values()
    assert ratios["prompt"]["ratio"] == pytest.approx(other_tokenizer.config.token_scale, rel=0.05)
    assert cost["actual_usd"] == pytest.approx(through["usd"], rel=0.05)
    assert cost["alone_usd"] == pytest.approx(direct["usd"], rel=0.10)


def test_lone_calls_are_all_samples_until_warm_then_one_in_sample_every() -> None:
    """A lone call's counts only teach the ratio: once warm, most are sent without being counted."""
    calibration = Calibration(warm_samples=3, sample_every=4)
    taken = [calibration.wants_sample("p", "m") for _ in range(12)]
    assert taken == [True, True, True, True, False, False, False, True, False, False, False, True]
    assert calibration.wants_sample("other", "m")  # each provider and model warms on its own
