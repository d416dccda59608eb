"""The provider prompt-cache model estimates cached prefixes by the provider's rules, in bounded memory."""

from __future__ import annotations

import pytest

from mergebroker.clock import FakeClock
from mergebroker.merge.pricing import CacheStyle
from mergebroker.merge.prompt_cache import CacheKey, PrefixCache, ProviderCacheModel

KEY = CacheKey("openai", "gpt-4o", "acct-1")
SYSTEM = list(range(100_000, 102_400))  # a 2,400-token shared system prompt


def _prompt(question_seed: int, length: int = 40) -> list[int]:
    return SYSTEM + [question_seed * 1000 + i for i in range(length)]


def _openai(clock=None, **kwargs) -> PrefixCache:
    return PrefixCache(ProviderCacheModel.for_style("openai"), clock=clock or FakeClock(), **kwargs)


def test_first_request_reads_nothing_from_cache():
    """A prefix nobody sent before is not cached."""
    assert _openai().observe(KEY, _prompt(1)) == 0


def test_shared_prefix_is_read_rounded_down_to_the_step():
    """A second request with the same system prompt reads its longest shared 128-token step: 2,304 of 2,400."""
    cache = _openai()
    cache.observe(KEY, _prompt(1))
    assert cache.observe(KEY, _prompt(2)) == 2304


def test_identical_request_reads_its_whole_prompt_down_to_the_step():
    """The same prompt again reads everything up to its last step boundary."""
    cache = _openai()
    cache.observe(KEY, _prompt(1))
    assert cache.observe(KEY, _prompt(1)) == 2432


def test_a_prefix_below_the_minimum_is_never_cached():
    """OpenAI caches nothing shorter than 1,024 tokens."""
    cache = _openai()
    short = SYSTEM[:1000]
    cache.observe(KEY, short + [1])
    assert cache.observe(KEY, short + [2]) == 0


@pytest.mark.parametrize("length, cached", [(1023, 0), (1024, 1024), (1151, 1024), (1152, 1152), (2400, 2304)])
def test_cacheable_rounds_down_in_steps_from_the_minimum(length, cached):
    """Cached tokens come in 128-token increments from 1,024."""
    assert ProviderCacheModel.for_style("openai").cacheable(length) == cached


def test_a_change_inside_the_prefix_limits_the_match():
    """Only the prefix before the first differing token can be read."""
    cache = _openai()
    cache.observe(KEY, _prompt(1))
    changed = _prompt(1)
    changed[1500] = 7
    assert cache.observe(KEY, changed) == 1408


def test_prefixes_expire_after_the_ttl():
    """Five minutes after its last use a prefix is no longer cached."""
    clock = FakeClock()
    cache = _openai(clock)
    cache.observe(KEY, _prompt(1))
    clock.advance(301)
    assert cache.observe(KEY, _prompt(2)) == 0


def test_each_use_refreshes_the_ttl():
    """A prefix read every four minutes stays cached."""
    clock = FakeClock()
    cache = _openai(clock)
    cache.observe(KEY, _prompt(1))
    for seed in range(2, 5):
        clock.advance(240)
        assert cache.observe(KEY, _prompt(seed)) == 2304


def test_keys_do_not_share_prefixes():
    """Another account, or another model, never reads this one's cache."""
    cache = _openai()
    cache.observe(KEY, _prompt(1))
    assert cache.observe(CacheKey("openai", "gpt-4o", "acct-2"), _prompt(2)) == 0
    assert cache.observe(CacheKey("openai", "gpt-4o-mini", "acct-1"), _prompt(2)) == 0


def test_lookup_estimates_without_recording():
    """`lookup` answers what a send would read, and leaves the cache as it was."""
    cache = _openai()
    assert cache.lookup(KEY, _prompt(1)).read_tokens == 0
    assert len(cache) == 0
    cache.record(KEY, _prompt(1))
    assert cache.lookup(KEY, _prompt(2)).read_tokens == 2304


def test_memory_is_bounded_and_short_shared_prefixes_survive():
    """A 20,000-token prompt fills at most max_entries digests, keeping its shortest prefixes."""
    cache = _openai(max_entries=8)
    long_prompt = SYSTEM + list(range(20_000))
    cache.observe(KEY, long_prompt)
    assert len(cache) == 8
    assert cache.observe(KEY, SYSTEM[:1500] + [7]) == 1408


def test_anthropic_reads_only_at_a_breakpoint_seen_before():
    """Claude reads a prefix that ended at a breakpoint before, and writes on to its last breakpoint."""
    cache = PrefixCache(ProviderCacheModel.for_style("anthropic"), clock=FakeClock())
    first = cache.lookup(KEY, _prompt(1), breakpoints=[2400])
    assert (first.read_tokens, first.write_tokens) == (0, 2400)
    cache.record(KEY, _prompt(1), breakpoints=[2400])
    second = cache.lookup(KEY, _prompt(2), breakpoints=[2400, 2440])
    assert (second.read_tokens, second.write_tokens) == (2400, 40)
    assert cache.lookup(KEY, _prompt(2)).read_tokens == 0
    assert cache.lookup(KEY, _prompt(2), breakpoints=[2000]).read_tokens == 0


def test_anthropic_ignores_breakpoints_below_the_minimum():
    """A breakpoint before 1,024 tokens caches nothing."""
    cache = PrefixCache(ProviderCacheModel.for_style("anthropic"), clock=FakeClock())
    cache.record(KEY, _prompt(1), breakpoints=[900])
    estimate = cache.lookup(KEY, _prompt(1), breakpoints=[900])
    assert (estimate.read_tokens, estimate.write_tokens, len(cache)) == (0, 0, 0)


def test_none_style_never_caches():
    """A provider without a prompt cache reads nothing and remembers nothing."""
    cache = PrefixCache(ProviderCacheModel.for_style(CacheStyle.NONE), clock=FakeClock())
    cache.observe(KEY, _prompt(1))
    assert cache.observe(KEY, _prompt(1)) == 0
    assert len(cache) == 0
