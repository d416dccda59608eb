"""The simulated upstream bills like a caching provider: OpenAI's automatic prompt cache by prefix, per key,
with a TTL on the injected clock, cached tokens in usage, and a running bill in dollars that a benchmark resets."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest

from mergebroker.clock import FakeClock
from mergebroker.providers.simulator.billing import cost_usd
from mergebroker.providers.simulator.content import count_tokens, prompt_token_ids, prompt_tokens
from mergebroker.providers.simulator.faults import SimulatorConfig
from mergebroker.providers.simulator.prompt_cache import PromptCache, prefix_digests
from mergebroker.providers.simulator.server import RunningSimulator, start_simulator

# A system prompt of about 1,500 tokens: past OpenAI's 1,024-token minimum, as a real policy preamble is.
SYSTEM = " ".join(f"Rule {i}: answer politely, cite the handbook section {i}, and never guess." for i in range(100))


def messages(question: str, system: str = SYSTEM) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def expected_cached(first: list[dict[str, str]], second: list[dict[str, str]]) -> int:
    """OpenAI's rule applied to the simulator's tokens: the shared prefix, down to 1,024 + a multiple of 128."""
    a, b = prompt_token_ids(first), prompt_token_ids(second)
    shared = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return 0 if shared < 1024 else 1024 + (shared - 1024) // 128 * 128


@pytest.fixture
async def caching_sim(fake_clock: FakeClock) -> AsyncIterator[RunningSimulator]:
    simulator = await start_simulator(SimulatorConfig(billing="openai"), clock=fake_clock)
    yield simulator
    await simulator.close()


async def chat_usage(sim: RunningSimulator, question: str, key: str = "key-a", **extra: Any) -> dict[str, Any]:
    async with openai.AsyncOpenAI(base_url=sim.url, api_key=key, max_retries=0) as client:
        reply = await client.chat.completions.create(model="sim-small", messages=messages(question), **extra)
    assert reply.usage is not None
    return reply.usage.model_dump(exclude_unset=True)  # only what the simulator sent


def test_the_prompt_is_counted_by_its_own_tokens_markers_included() -> None:
    question = "What is the capital of France?"
    convo = messages(question)
    assert len(prompt_token_ids(convo)) == prompt_tokens(convo) == count_tokens(SYSTEM) + count_tokens(question) + 9
    as_user = [{"role": "user", "content": SYSTEM}, convo[1]]
    assert prompt_token_ids(as_user) != prompt_token_ids(convo)  # the role is part of the prefix


def test_prefixes_are_cacheable_from_1024_tokens_in_128_token_steps_and_scoped() -> None:
    ids = list(range(1500))
    digests = prefix_digests("key-a", ids)
    assert [length for length, _ in digests] == [1024, 1152, 1280, 1408]
    assert prefix_digests("key-a", ids[:1300] + [7] * 200)[:3] == digests[:3]
    assert prefix_digests("key-a", ids[:1300] + [7] * 200)[3] != digests[3]
    assert not set(prefix_digests("key-b", ids)) & set(digests)
    assert prefix_digests("key-a", ids[:1023]) == []


def test_a_cached_prefix_is_read_back_until_its_ttl_after_its_last_use(fake_clock: FakeClock) -> None:
    cache = PromptCache(fake_clock)
    prompt = list(range(2000))
    assert cache.use("k", prompt, ttl_s=300) == 0
    assert cache.use("k", prompt[:1700] + [9] * 50, ttl_s=300) == 1664
    assert cache.use("other", prompt, ttl_s=300) == 0
    fake_clock.advance(299)
    assert cache.use("k", prompt, ttl_s=300) == 1920  # a hit refreshes the prefix: 300 s from now
    fake_clock.advance(299)
    assert cache.use("k", prompt, ttl_s=300) == 1920
    fake_clock.advance(300)
    assert cache.use("k", prompt, ttl_s=300) == 0
    assert cache.use("k", list(range(1000)), ttl_s=300) == 0


def test_the_cache_stays_bounded_and_drops_expired_prefixes(fake_clock: FakeClock) -> None:
    cache = PromptCache(fake_clock, max_entries=10)
    for start in range(5):
        cache.use("k", [start] + list(range(1400)), ttl_s=60)  # 3 prefixes each
    assert len(cache) == 10
    fake_clock.advance(60)
    cache.use("k", list(range(1100)), ttl_s=60)
    assert len(cache) == 1


def test_a_call_costs_fresh_cached_and_output_tokens_at_their_prices() -> None:
    config = SimulatorConfig(price_input=2.5, price_cached_input=1.25, price_output=10)
    assert cost_usd(1_000_000, 0, 0, config) == pytest.approx(2.5)
    assert cost_usd(2000, 1024, 100, config) == pytest.approx((976 * 2.5 + 1024 * 1.25 + 100 * 10) / 1e6)


async def test_a_repeated_prefix_is_reported_as_cached_tokens_like_openai(caching_sim: RunningSimulator) -> None:
    first = await chat_usage(caching_sim, "Where is my parcel?")
    second = await chat_usage(caching_sim, "Can I change my address?")
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert cached == expected_cached(messages("Where is my parcel?"), messages("Can I change my address?"))
    assert 1024 <= cached < second["prompt_tokens"] and cached % 128 == 0
    assert second["completion_tokens_details"]["reasoning_tokens"] == 0
    assert second["prompt_tokens"] == prompt_tokens(messages("Can I change my address?"))


async def test_each_api_key_has_its_own_cache_unless_the_scope_is_global(caching_sim: RunningSimulator) -> None:
    await chat_usage(caching_sim, "Where is my parcel?", key="key-a")
    assert (await chat_usage(caching_sim, "Where is my parcel?", key="key-b"))["prompt_tokens_details"] == \
        {"cached_tokens": 0, "audio_tokens": 0}
    caching_sim.set_faults(cache_scope="global")
    await chat_usage(caching_sim, "Where is my parcel?", key="key-c")
    usage = await chat_usage(caching_sim, "Where is my parcel?", key="key-d")
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 1024


async def test_the_cache_expires_on_the_injected_clock(caching_sim: RunningSimulator,
                                                       fake_clock: FakeClock) -> None:
    await chat_usage(caching_sim, "Where is my parcel?")
    fake_clock.advance(299)
    assert (await chat_usage(caching_sim, "Where is my parcel?"))["prompt_tokens_details"]["cached_tokens"] > 0
    fake_clock.advance(300)
    assert (await chat_usage(caching_sim, "Where is my parcel?"))["prompt_tokens_details"]["cached_tokens"] == 0
    caching_sim.set_faults(cache_ttl_s=10)
    fake_clock.advance(11)
    assert (await chat_usage(caching_sim, "Where is my parcel?"))["prompt_tokens_details"]["cached_tokens"] == 0


async def test_a_streamed_reply_reports_cached_tokens_in_its_usage_chunk(caching_sim: RunningSimulator) -> None:
    await chat_usage(caching_sim, "Where is my parcel?")
    async with openai.AsyncOpenAI(base_url=caching_sim.url, api_key="key-a", max_retries=0) as client:
        stream = await client.chat.completions.create(model="sim-small", messages=messages("Where is my parcel?"),
                                                      stream=True, stream_options={"include_usage": True})
        usages = [chunk.usage async for chunk in stream if chunk.usage is not None]
    assert len(usages) == 1 and usages[0].prompt_tokens_details is not None
    assert usages[0].prompt_tokens_details.cached_tokens >= 1024


async def test_the_bill_adds_up_tokens_and_dollars_and_resets_for_a_second_arm(
        caching_sim: RunningSimulator) -> None:
    usages = [await chat_usage(caching_sim, q) for q in ("Where is my parcel?", "Can I change my address?")]
    async with aiohttp.ClientSession() as http:
        async with http.get(caching_sim.url + "/_sim/bill") as resp:
            bill = await resp.json()
        async with http.get(caching_sim.url.removesuffix("/v1") + "/stats") as resp:
            assert (await resp.json())["bill"] == bill
        prompt = sum(u["prompt_tokens"] for u in usages)
        cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
        completion = sum(u["completion_tokens"] for u in usages)
        assert (bill["requests"], bill["prompt_tokens"], bill["cached_tokens"], bill["completion_tokens"]) == \
            (2, prompt, cached, completion)
        assert bill["usd"] == pytest.approx(((prompt - cached) * 2.5 + cached * 1.25 + completion * 10) / 1e6)
        assert bill["billing"] == "openai" and bill["prices_usd_per_million"]["cached_input"] == 1.25
        async with http.post(caching_sim.url + "/_sim/bill/reset", json={"keep_cache": True}) as resp:
            assert (await resp.json())["requests"] == 0
        assert (await chat_usage(caching_sim, "Where is my parcel?"))["prompt_tokens_details"]["cached_tokens"] > 0
        async with http.post(caching_sim.url + "/_sim/bill/reset") as resp:
            assert resp.status == 200 and (await resp.json())["usd"] == 0
        async with http.post(caching_sim.url + "/_sim/bill/reset", data="[1]") as resp:
            assert resp.status == 400 and (await resp.json())["error"]["type"] == "invalid_request_error"
    assert (await chat_usage(caching_sim, "Where is my parcel?"))["prompt_tokens_details"]["cached_tokens"] == 0
    assert caching_sim.stats()["chat_calls"] == 4  # resetting the bill leaves the other counters alone


async def test_without_billing_usage_stays_plain_but_the_bill_runs_at_prices_set_at_run_time() -> None:
    async with await start_simulator() as sim:
        first = await chat_usage(sim, "Where is my parcel?")
        second = await chat_usage(sim, "Where is my parcel?")
        assert set(first) == {"prompt_tokens", "completion_tokens", "total_tokens"}
        sim.set_faults(price_input=1.0, price_output=0.0)
        await chat_usage(sim, "Where is my parcel?")
        bill = sim.bill()
    tokens = first["prompt_tokens"] + second["prompt_tokens"]
    output = first["completion_tokens"] + second["completion_tokens"]
    assert bill["cached_tokens"] == 0 and bill["requests"] == 3
    assert bill["usd"] == pytest.approx((tokens * 2.5 + output * 10 + first["prompt_tokens"] * 1.0) / 1e6)


async def test_faulted_calls_are_not_billed_and_bad_bill_settings_are_refused() -> None:
    async with await start_simulator(SimulatorConfig(error_rate=1.0)) as sim:
        async with aiohttp.ClientSession() as http:
            async with http.post(sim.url + "/chat/completions",
                                 json={"model": "m", "messages": messages("hi")}) as resp:
                assert resp.status == 500
            for bad in ({"billing": "anthropic"}, {"cache_scope": "org"}, {"price_output": -1},
                        {"cache_ttl_s": 0}):
                async with http.post(sim.url + "/control/faults", data=json.dumps(bad)) as resp:
                    assert resp.status == 400 and (await resp.json())["error"]["type"] == "invalid_request_error"
        assert sim.bill()["requests"] == 0 and sim.config.billing == "none"
