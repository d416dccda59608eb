"""The bulk planner merges where the live path would: on cost over the price table, within the model's output
limit and real context window (the shared system prompt counted once), each member keeping its own budget."""

from __future__ import annotations

from mergebroker.broker.bulk.items import ItemContext, bulk_items
from mergebroker.broker.bulk.lines import BatchLine
from mergebroker.broker.bulk.runner import BulkEconomics
from mergebroker.broker.engine.accounting.costs import CostBook
from mergebroker.broker.engine.accounting.merge_economy import economy_for
from mergebroker.broker.engine.ground.config import load_settings
from mergebroker.broker.engine.ground.tokens import count_text_tokens
from mergebroker.clock import FakeClock
from mergebroker.merge.compaction import CompactionRules, PlannedCall, plan_compaction
from mergebroker.merge.prompt import response_tag_tokens

PRICE = {"input": 2.5, "cached_input": 1.25, "output": 10}  # gpt-4o's list prices
SYSTEM = " ".join(["Answer questions about the manual of the Nimbus product, plainly and briefly."] * 150)
SHORT = [f"What is {n} plus {n}?" for n in range(4)]


def plan(lines: list[BatchLine], *, price: dict | None = None, policy: str = "cost", max_batch: int = 8,
         **merge) -> list[PlannedCall]:
    """Describe `lines` as the runner does and plan them with the broker's economics for model "m"."""
    settings = load_settings(None, environ={}, overrides={
        "merge": {"embedder": "none", "policy": policy, **merge}, "pricing": {"m": price} if price else {},
        "tiers": [{"name": "batch", "max_batch": max_batch, "similarity_threshold": 0.0}], "default_tier": "batch"})
    items, refused = bulk_items(lines, ItemContext(settings, "batch", "t", frozenset({"m"}), frozenset({"m"})))
    assert refused == []
    economy = economy_for(settings, CostBook(settings.price_table()), FakeClock())
    rules = CompactionRules(0.0, max_batch, lambda model: economy.context_window(model, 8192), None, False,
                            count_text_tokens, BulkEconomics(economy))
    return plan_compaction(items, rules)


def line(custom_id: str, question: str, system: str | None = None, **extra) -> BatchLine:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return BatchLine(custom_id, "/v1/chat/completions", {"model": "m", "messages": messages, "max_tokens": 50, **extra})


def sizes(calls: list[PlannedCall]) -> list[int]:
    return [len(c.members) for c in calls]


def test_short_questions_go_alone_where_request_tags_would_cost_more_than_they_save():
    assert sizes(plan([line(f"q{n}", q) for n, q in enumerate(SHORT)], price=PRICE)) == [1, 1, 1, 1]


def test_a_long_shared_system_prompt_makes_the_merge_pay():
    calls = plan([line(f"q{n}", q, SYSTEM) for n, q in enumerate(SHORT)], price=PRICE)
    assert sizes(calls) == [4] and calls[0].body["messages"][0]["content"] == SYSTEM


def test_policy_always_and_unpriced_models_merge_as_before():
    lines = [line(f"q{n}", q) for n, q in enumerate(SHORT)]
    assert sizes(plan(lines, price=PRICE, policy="always")) == [4]
    assert sizes(plan(lines)) == [4]


def test_merged_calls_ask_for_no_more_output_than_the_model_gives():
    # 30 tokens each plus the tags: two fit under 100, three do not, so fewer members per call.
    limited = {**PRICE, "max_output_tokens": 100}
    calls = plan([line(f"q{n}", q, SYSTEM, max_tokens=30) for n, q in enumerate(SHORT)], price=limited)
    assert sizes(calls) == [2, 2]
    assert all(c.body["max_tokens"] <= 100 for c in calls)


def test_the_shared_system_prompt_counts_once_against_the_models_real_context_window():
    shared = count_text_tokens(SYSTEM)
    # Room for the shared prompt once and eight short members: never for two copies of it.
    window = {**PRICE, "context_window": shared + 1500}
    calls = plan([line(f"q{n}", f"Question {n}: how do I reset device {n}?", SYSTEM) for n in range(8)],
                 price=window, policy="always")
    assert sizes(calls) == [8]
    small = {**PRICE, "context_window": shared + 400}  # the header and a few members' budgets: not eight
    assert 1 < len(plan([line(f"q{n}", f"Question {n}?", SYSTEM) for n in range(8)], price=small,
                        policy="always")) < 8


def test_each_member_keeps_its_own_budget_and_the_merged_budget_holds_them_all():
    lines = [line("a", "first", max_tokens=12), line("b", "second", max_completion_tokens=7, max_tokens=None),
             line("c", "third", max_tokens=None)]
    (call,) = plan(lines, default_max_tokens=40)
    assert [m.max_tokens for m in call.members] == [12, 7, None]  # "c" is cut only where the provider cuts it
    tags = sum(response_tag_tokens(m.tag, count_text_tokens) for m in call.members)
    assert call.body["max_tokens"] == 12 + 7 + 40 + tags
    assert PlannedCall.from_json(call.to_json()) == call


def test_a_plan_stored_before_members_had_budgets_still_reads():
    (call,) = plan([line("a", "first"), line("b", "second")])
    stored = call.to_json()
    for member in stored["members"]:
        del member["max_tokens"]
    assert [m.max_tokens for m in PlannedCall.from_json(stored).members] == [None, None]

