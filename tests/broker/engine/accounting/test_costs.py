"""Dollars per request: the actual bill from reported usage, the alone bill with the provider's prompt cache."""

from __future__ import annotations

import pytest

from mergebroker.broker.engine.accounting.costs import CostBook
from mergebroker.broker.engine.accounting.request_record import RequestInfo
from mergebroker.broker.engine.ground.metrics import Metrics
from mergebroker.clock import FakeClock
from mergebroker.merge.pricing import PriceTable

PRICES = PriceTable.build({"m4o": {"input": 2.5, "cached_input": 1.25, "output": 10}})
SYSTEM = "You are a careful assistant. " * 300  # about 1,800 tokens: over the 1,024-token cache minimum


def info(**fields) -> RequestInfo:
    base = RequestInfo("r", "r", tier="batch", model="m4o", provider="p", cache="miss", batch_size=1)
    for name, value in fields.items():
        setattr(base, name, value)
    return base


def book() -> CostBook:
    return CostBook(PRICES, metrics=Metrics(), clock=FakeClock())


def test_a_request_sent_alone_costs_the_same_both_ways_priced_with_its_cached_part() -> None:
    costs = book()
    actual, alone = costs.account(info(prompt_tokens=2000, cached_tokens=1024, completion_tokens=100,
                                       alone_prompt_tokens=2000, answer_tokens=100), 200)
    expected = (976 * 2.5 + 1024 * 1.25 + 100 * 10) / 1e6
    assert actual == pytest.approx(expected) and alone == actual
    assert costs.totals.as_dict()["saved_usd"] == 0


def test_a_merged_member_is_priced_alone_in_the_providers_tokens_and_saves_against_that() -> None:
    costs = book()
    # Calls sent alone teach the broker that this provider counts 20% more prompt tokens than it does.
    for _ in range(60):
        costs.account(info(prompt_tokens=1200, completion_tokens=50, alone_prompt_tokens=1000, answer_tokens=50), 200)
    member = info(batch_size=8, prompt_tokens=300, cached_tokens=200, completion_tokens=60,
                  alone_prompt_tokens=1000, alone_cached_tokens=0, answer_tokens=50)
    actual, alone = costs.account(member, 200)
    assert actual == pytest.approx((100 * 2.5 + 200 * 1.25 + 60 * 10) / 1e6)
    assert alone == pytest.approx((1200 * 2.5 + 50 * 10) / 1e6, rel=0.02)
    tier = costs.totals.as_dict()["tiers"]["batch"]
    assert tier["saved_usd"] == pytest.approx(alone - actual, abs=1e-6)


def test_a_repeated_long_prefix_would_have_been_read_from_the_providers_cache_alone() -> None:
    costs = book()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question"}]
    assert costs.observe_alone("p", "m4o", messages) == 0
    second = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "another question"}]
    cached = costs.observe_alone("p", "m4o", second)
    assert cached >= 1024 and cached % 128 == 0
    assert costs.observe_alone("other-provider", "m4o", second) == 0


def test_a_prompt_too_short_for_the_providers_cache_is_not_tokenized(monkeypatch) -> None:
    """Most prompts are under the 1,024-token minimum: they read and record nothing, and cost no tokenization."""
    from mergebroker.broker.engine.accounting import costs as costs_module

    tokenized: list[object] = []
    real = costs_module.prompt_token_ids
    monkeypatch.setattr(costs_module, "prompt_token_ids", lambda messages: tokenized.append(messages) or real(messages))
    costs = book()
    short = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    assert costs.observe_alone("p", "m4o", short) == 0 and costs.observe_alone("p", "m4o", short) == 0
    assert tokenized == []
    long = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question"}]
    costs.observe_alone("p", "m4o", long)
    assert costs.observe_alone("p", "m4o", long) >= 1024 and len(tokenized) == 2


def test_a_reused_answer_costs_nothing_and_an_unpriced_model_gets_no_dollars() -> None:
    costs = book()
    actual, alone = costs.account(info(cache="hit", completion_tokens=40, alone_prompt_tokens=100), 200)
    assert actual == 0 and alone == pytest.approx((100 * 2.5 + 40 * 10) / 1e6)
    assert costs.account(info(model="nobody-prices-this"), 200) == (None, None)
    assert costs.totals.unpriced_requests == 1


def test_dollars_reach_the_cost_metric_by_tier_model_and_kind() -> None:
    metrics = Metrics()
    costs = CostBook(PRICES, metrics=metrics, clock=FakeClock())
    costs.account(info(prompt_tokens=1000, completion_tokens=100, alone_prompt_tokens=1000), 200)
    sample = metrics.registry.get_sample_value("mergebroker_cost_usd_total",
                                               {"tier": "batch", "model": "m4o", "kind": "actual"})
    assert sample == pytest.approx((1000 * 2.5 + 100 * 10) / 1e6)
