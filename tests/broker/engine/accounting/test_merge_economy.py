"""Planned batches merge only as far as merging pays, at the model's prices and with the provider's cache."""

from __future__ import annotations

from mergebroker.broker.engine.accounting.costs import CostBook
from mergebroker.broker.engine.accounting.merge_economy import Candidate, MergeEconomy
from mergebroker.broker.engine.ground.tokens import count_text_tokens
from mergebroker.clock import FakeClock
from mergebroker.merge.merge_cost import MergePolicy
from mergebroker.merge.pricing import PriceTable

PRICES = PriceTable.build({"m4o": {"input": 2.5, "cached_input": 1.25, "output": 10},
                           "m5": {"input": 1.25, "cached_input": 0.125, "output": 10}})
LONG_SYSTEM = "You answer questions about the product manual. " * 250  # about 2,400 tokens


def economy(*, by_cost: bool = True, policy: MergePolicy = MergePolicy()) -> MergeEconomy:
    clock = FakeClock()
    return MergeEconomy(CostBook(PRICES, clock=clock), policy=policy, by_cost=by_cost, header_tokens=60,
                        count=count_text_tokens, clock=clock)


def batch(n: int, system: str | None, question: int, answer: int = 85) -> list[Candidate]:
    shared = count_text_tokens(system) if system else 0
    return [Candidate(prompt_tokens=shared + question + 10, question_tokens=question, max_tokens=answer)
            for _ in range(n)]


def test_a_long_shared_system_prompt_merges_the_whole_batch_at_both_price_points() -> None:
    for model in ("m4o", "m5"):
        eco = economy()
        eco.split(model, LONG_SYSTEM, batch(8, LONG_SYSTEM, 40))  # warms the provider's cache of merged prefixes
        assert eco.split(model, LONG_SYSTEM, batch(8, LONG_SYSTEM, 40)) == [8]
        assert eco.last[0].merged_usd < eco.last[0].alone_usd


def test_short_questions_without_a_system_prompt_are_sent_alone_because_tags_cost_more() -> None:
    eco = economy()
    assert eco.split("m4o", None, batch(8, None, 15)) == [1] * 8
    assert eco.last[0].reason == "not_cheaper"


def test_a_binding_rate_limit_buys_capacity_within_the_premium() -> None:
    eco = economy(policy=MergePolicy(capacity_merge=True, pressure_threshold=0.9, max_premium=1.5))
    sizes = eco.split("m4o", None, batch(4, None, 15), rpm_pressure=1.0)
    assert sizes[0] > 1 and eco.last[0].reason == "capacity"


def test_an_unpriced_model_or_policy_always_merges_whole_batches_as_before() -> None:
    assert economy().split("nobody-prices-this", None, batch(8, None, 15)) == [8]
    assert economy(by_cost=False).split("m4o", None, batch(8, None, 15)) == [8]
