"""Prices are found by model name with provider, date and variant normalisation, validated, and bill a call."""

from __future__ import annotations

import json

import pytest

from mergebroker.merge.default_prices import DEFAULT_PRICES
from mergebroker.merge.pricing import CacheStyle, ModelPrice, PriceTable, cost_usd, parse_prices, prices_from_litellm

GPT_4O = ModelPrice(input=2.50, cached_input=1.25, output=10.00, cache=CacheStyle.OPENAI)


def test_default_table_holds_known_list_prices():
    """The shipped table prices gpt-4o and gpt-5 at their list prices and Claude with a cache-write premium."""
    table = PriceTable.build()
    gpt_4o, gpt_5, sonnet = table.get("gpt-4o"), table.get("gpt-5"), table.get("claude-sonnet-4")
    assert (gpt_4o.input, gpt_4o.cached_input, gpt_4o.output) == (2.50, 1.25, 10.00)
    assert (gpt_5.input, gpt_5.cached_input, gpt_5.output) == (1.25, 0.125, 10.00)
    assert (sonnet.cached_input, sonnet.cache_write, sonnet.cache) == (0.30, 3.75, CacheStyle.ANTHROPIC)


def test_every_default_entry_states_its_limits_and_cache_style():
    """No default model is left without a context window, a max output or a cache style."""
    for name, price in parse_prices(DEFAULT_PRICES).items():
        assert price.context_window and price.max_output_tokens, name
        assert "cache" in DEFAULT_PRICES[name], name


def test_the_simulators_models_are_unpriced_unless_configured():
    """The offline demo merges as before prices (nobody bills for the simulator); `pricing` can price them."""
    assert PriceTable.build().get("sim-small") is None
    table = PriceTable.build({"sim-small": {"input": 0.15, "cached_input": 0.075, "output": 0.6}})
    assert table.get("sim-small") is not None


@pytest.mark.parametrize("name", ["openai/gpt-4o", "azure/gpt-4o", "GPT-4o", " gpt-4o "])
def test_lookup_ignores_provider_prefix_and_case(name):
    """A provider prefix, capitals or surrounding spaces do not hide a known model."""
    assert PriceTable.build().resolve(name) == "gpt-4o"


@pytest.mark.parametrize("name, expected", [
    ("gpt-4o-2024-08-06", "gpt-4o"),
    ("claude-3-5-haiku-20241022", "claude-3-5-haiku"),
    ("anthropic/claude-sonnet-4-5-20250929", "claude-sonnet-4-5"),
    ("gpt-4.1-mini-2025-04-14", "gpt-4.1-mini"),
])
def test_lookup_strips_date_suffixes(name, expected):
    """Dated snapshots in both date styles find their undated alias."""
    assert PriceTable.build().resolve(name) == expected


def test_lookup_falls_back_to_the_longest_known_prefix():
    """`gpt-4o-mini-foo` is priced as gpt-4o-mini, not as the shorter gpt-4o."""
    table = PriceTable.build()
    assert table.resolve("gpt-4o-mini-foo") == "gpt-4o-mini"
    assert table.resolve("claude-3-5-haiku-latest") == "claude-3-5-haiku"


def test_prefix_fallback_needs_a_separator():
    """A name that merely starts with a known name's characters (`gpt-4.1`, `gpt-4o`) is not that model."""
    table = PriceTable({"gpt-4": GPT_4O})
    assert table.get("gpt-4.1") is None
    assert table.get("gpt-4o") is None
    assert table.get("gpt-4-turbo") == GPT_4O


def test_pro_models_do_not_fall_back_to_their_cheaper_base():
    """o3-pro and gpt-5-pro have their own prices rather than o3's or gpt-5's."""
    table = PriceTable.build()
    assert table.get("o3-pro").output == 80.00
    assert table.get("gpt-5-pro-2025-10-06").output == 120.00


def test_unknown_model_is_unpriced():
    """A model no rule matches has no price."""
    assert PriceTable.build().get("my-local-llama") is None


def test_exact_name_wins_over_a_normalised_one():
    """An `azure/` entry of its own is used for that name, and the plain entry for the bare name."""
    azure = ModelPrice(input=2.75, cached_input=1.375, output=11.0)
    table = PriceTable({"gpt-4o": GPT_4O, "azure/gpt-4o": azure})
    assert table.get("azure/gpt-4o") == azure
    assert table.get("openai/gpt-4o") == GPT_4O


def test_alias_maps_a_deployment_name_to_its_model():
    """An Azure deployment named by its operator is priced as the model it serves."""
    table = PriceTable.build(aliases={"prod-chat": "gpt-4o-mini"})
    assert table.resolve("azure/prod-chat") == "gpt-4o-mini"
    assert table.resolve("prod-chat") == "gpt-4o-mini"
    assert table.resolve("prod-chat-2024-07-18") == "gpt-4o-mini"


def test_config_overrides_a_default_and_keeps_its_limits():
    """An operator's negotiated price replaces the list price; the model's limits and cache style stay."""
    table = PriceTable.build({"gpt-4o": {"input": 2.0, "cached_input": 1.0, "output": 8.0}})
    price = table.get("gpt-4o")
    assert (price.input, price.output) == (2.0, 8.0)
    assert (price.context_window, price.max_output_tokens, price.cache) == (128_000, 16_384, CacheStyle.OPENAI)


@pytest.mark.parametrize("fields, style", [
    ({"input": 1.0, "cached_input": 0.5, "output": 2.0}, CacheStyle.OPENAI),
    ({"input": 1.0, "cached_input": 0.1, "cache_write": 1.25, "output": 2.0}, CacheStyle.ANTHROPIC),
    ({"input": 1.0, "cached_input": 1.0, "output": 2.0}, CacheStyle.NONE),
    ({"input": 1.0, "cached_input": 0.5, "output": 2.0, "cache": "none"}, CacheStyle.NONE),
])
def test_config_adds_a_new_model_and_infers_its_cache_style(fields, style):
    """A new model's cache style follows its prices unless stated."""
    assert PriceTable.build({"house-model": fields}).get("house-model").cache == style


@pytest.mark.parametrize("fields, field", [
    ({"input": -1, "cached_input": 0.5, "output": 2.0}, "input"),
    ({"input": 1.0, "cached_input": "0.5", "output": 2.0}, "cached_input"),
    ({"input": 1.0, "cached_input": 0.5, "output": True}, "output"),
    ({"input": 1.0, "cached_input": 0.5, "output": float("nan")}, "output"),
    ({"input": 1.0, "cached_input": 0.5, "output": 2.0, "context_window": 0}, "context_window"),
    ({"input": 1.0, "cached_input": 0.5, "output": 2.0, "cache": "gemini"}, "cache"),
    ({"input": 1.0, "output": 2.0}, "cached_input"),
    ({"input": 1.0, "cached_input": 0.5, "ouput": 2.0}, "ouput"),
])
def test_config_error_names_the_model_and_the_field(fields, field):
    """A malformed entry is refused with a message that says which model and which field."""
    with pytest.raises(ValueError, match=rf"'house-model'.*'{field}'"):
        PriceTable.build({"house-model": fields})


def _litellm_file(tmp_path, entries):
    path = tmp_path / "model_prices_and_context_window.json"
    path.write_text(json.dumps(entries))
    return path


def test_litellm_file_is_read_per_million_and_skips_non_chat_entries(tmp_path):
    """Per-token costs become per-million prices; embeddings, unpriced entries and the sample spec are skipped."""
    path = _litellm_file(tmp_path, {
        "sample_spec": {"input_cost_per_token": 0.0, "output_cost_per_token": 0.0, "mode": "chat"},
        "deepthing-1": {"input_cost_per_token": 2.5e-06, "output_cost_per_token": 1e-05,
                        "cache_read_input_token_cost": 1.25e-06, "max_input_tokens": 128000,
                        "max_output_tokens": 16384, "litellm_provider": "openai", "mode": "chat"},
        "embedder-1": {"input_cost_per_token": 1e-07, "output_cost_per_token": 0.0, "mode": "embedding"},
        "mystery-1": {"max_input_tokens": 8192, "mode": "chat"},
    })
    table = PriceTable.build(litellm_path=path)
    price = table.get("deepthing-1")
    assert (price.input, price.cached_input, price.output) == (2.5, 1.25, 10.0)
    assert (price.context_window, price.max_output_tokens, price.cache) == (128_000, 16_384, CacheStyle.OPENAI)
    assert table.get("embedder-1") is None and table.get("mystery-1") is None and table.get("sample_spec") is None


def test_litellm_claude_entry_gets_anthropic_cache_style_and_write_price():
    """A Claude entry keeps LiteLLM's cache-creation price as the write price."""
    prices = prices_from_litellm({"claude-x": {
        "input_cost_per_token": 3e-06, "output_cost_per_token": 1.5e-05, "cache_read_input_token_cost": 3e-07,
        "cache_creation_input_token_cost": 3.75e-06, "litellm_provider": "anthropic", "mode": "chat"}})
    assert (prices["claude-x"].cache_write, prices["claude-x"].cache) == (3.75, CacheStyle.ANTHROPIC)


def test_config_overrides_the_litellm_file_which_overrides_defaults(tmp_path):
    """Precedence is config over the LiteLLM file over the shipped defaults."""
    path = _litellm_file(tmp_path, {
        "gpt-4o": {"input_cost_per_token": 3e-06, "output_cost_per_token": 1.2e-05, "mode": "chat"},
        "gpt-5": {"input_cost_per_token": 9e-06, "output_cost_per_token": 9e-06, "mode": "chat"}})
    table = PriceTable.build({"gpt-5": {"input": 1.0, "cached_input": 0.1, "output": 8.0}}, litellm_path=path)
    assert table.get("gpt-4o").input == 3.0
    assert table.get("gpt-5").input == 1.0
    assert table.get("gpt-4o-mini").input == 0.15


def test_cost_bills_cached_tokens_as_part_of_the_prompt():
    """Cached tokens are inside prompt_tokens and billed at the cached price, the rest at the input price."""
    bill = cost_usd(GPT_4O, prompt_tokens=3000, cached_tokens=2048, completion_tokens=100)
    assert bill == pytest.approx((952 * 2.50 + 2048 * 1.25 + 100 * 10.00) / 1e6)


def test_cost_bills_cache_writes_at_the_write_price_or_the_input_price():
    """Anthropic cache writes cost the write premium; a model without one bills them as input."""
    claude = ModelPrice(input=3.0, cached_input=0.3, output=15.0, cache_write=3.75, cache=CacheStyle.ANTHROPIC)
    assert cost_usd(claude, 2000, cached_tokens=1000, cache_write_tokens=1000) == pytest.approx(
        (1000 * 0.3 + 1000 * 3.75) / 1e6)
    assert cost_usd(GPT_4O, 2000, cache_write_tokens=1000) == pytest.approx(2000 * 2.50 / 1e6)


def test_cost_refuses_more_cached_than_prompt_tokens():
    """Counts that cannot come from one call are an error, not a negative bill."""
    with pytest.raises(ValueError, match="must not exceed"):
        cost_usd(GPT_4O, prompt_tokens=100, cached_tokens=80, cache_write_tokens=30)
    with pytest.raises(ValueError, match="completion_tokens"):
        cost_usd(GPT_4O, prompt_tokens=100, completion_tokens=-1)


def test_resolution_stays_right_past_the_remembered_names() -> None:
    """Names come from clients: however many unknown ones arrive, known models still resolve and unknown stay None."""
    table = PriceTable.build({"my-model": {"input": 1, "cached_input": 0.5, "output": 2}})
    for i in range(3000):
        assert table.resolve(f"unknown-{i}") is None
    assert table.resolve("my-model") == "my-model" and table.resolve("My-Model-2025-01-01") == "my-model"
