"""How many of a planned batch merge, on cost: the engine's side of `merge.merge_cost.decide`.

Dispatch plans batches of compatible, similar requests; this turns each into the merges worth making
(`split`), with the rule of `merge.merge_cost` (merge the largest leading run whose merged bill is below
its members' bills alone; under a binding provider RPM, accept up to `capacity_max_premium` more). The
token counts it prices are the broker's own, scaled into the provider's by the `CostBook`'s calibration;
the shared prefix of a merged call (system prompt and header) is counted once, and is priced as cached
when the provider cache would hold it: at least the cache's minimum and sent recently. Alone, each member
pays its own system prompt, at the cached price when the model of the provider's cache says a request
sent alone would read it (the first member of a cold prefix pays it in full; the others find it warm).

`merge.policy: always`, or a model with no price, merges every batch whole, as before prices.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from mergebroker.broker.engine.accounting.costs import CostBook
from mergebroker.broker.engine.ground.settings import Settings
from mergebroker.broker.engine.ground.tokens import count_text_tokens
from mergebroker.clock import Clock
from mergebroker.merge.merge_cost import MemberTokens, MergeDecision, MergeLayout, MergePolicy, decide
from mergebroker.merge.pricing import CacheStyle
from mergebroker.merge.prompt import DEFAULT_HEADER
from mergebroker.merge.prompt_cache import CacheKey, PrefixCache, ProviderCacheModel


@dataclass(frozen=True, slots=True)
class Candidate:
    """One request of a planned batch, as pricing sees it (broker token counts)."""

    prompt_tokens: int  # its whole prompt sent alone
    question_tokens: int  # its user text: what it adds to a merged call
    max_tokens: int


FRAMING_TOKENS = 7
"""The chat framing around a request's system and user messages (3 per message, 3 priming, roles)."""


class MergeEconomy:
    """Splits planned batches into the merges that pay (see the module docstring)."""

    def __init__(self, costs: CostBook, *, policy: MergePolicy, by_cost: bool, header_tokens: int,
                 count: Callable[[str], int], clock: Callable[[], float]) -> None:
        self._costs = costs
        self._policy = policy
        self._by_cost = by_cost
        self._header = header_tokens
        self._count = count
        self._sent = {style: PrefixCache(ProviderCacheModel.for_style(style), max_entries=10_000, clock=clock)
                      for style in (CacheStyle.OPENAI, CacheStyle.ANTHROPIC)}
        self.last: list[MergeDecision] = []  # the decisions of the latest `split`, for counters and tests

    def max_output_tokens(self, model: str) -> int | None:
        """The most output one call to `model` may ask for, from the price table; None where unknown."""
        price = self._costs.price(model)
        return price.max_output_tokens if price is not None else None

    def context_window(self, model: str, default: int) -> int:
        """The model's context window from the price table, else `default` (the configured limit)."""
        price = self._costs.price(model)
        return price.context_window if price is not None and price.context_window else default

    def split(self, model: str, system_prompt: str | None, batch: Sequence[Candidate], *,
              rpm_pressure: float = 0.0, tag_tokens: int = 0) -> list[int]:
        """The sizes, in order, that `batch` is cut into (a size of 1 is a request sent alone): first so that
        no merged call asks for more output than the model can give (its members' budgets plus
        `tag_tokens` each), then on cost."""
        sizes: list[int] = []
        self.last = []
        start = 0
        for size in self._output_fits(model, batch, tag_tokens):
            sizes += self._on_cost(model, system_prompt, batch[start:start + size], rpm_pressure)
            start += size
        return sizes

    def _output_fits(self, model: str, batch: Sequence[Candidate], tag_tokens: int) -> list[int]:
        """`batch` cut, in order, into runs whose summed output budgets fit the model's output limit (a member
        over the limit on its own goes alone: the provider judges it as it would any request)."""
        limit = self.max_output_tokens(model)
        if not limit:
            return [len(batch)]
        sizes, run, used = [], 0, 0
        for candidate in batch:
            need = candidate.max_tokens + tag_tokens
            if run and used + need > limit:
                sizes.append(run)
                run, used = 0, 0
            run, used = run + 1, used + need
        return [*sizes, run]

    def _on_cost(self, model: str, system_prompt: str | None, batch: Sequence[Candidate],
                 rpm_pressure: float) -> list[int]:
        price = self._costs.price(model)
        if not self._by_cost or price is None or len(batch) < 2:
            return [len(batch)]
        shared = self._count(system_prompt) if system_prompt else 0
        warm = self._warm(model, system_prompt, price.cache, shared)
        rules = ProviderCacheModel.for_style(price.cache)
        cacheable = rules.cacheable(shared + FRAMING_TOKENS) if shared else 0
        # The header never changes, so the cache holds it with the system prompt: OpenAI's caches on past the
        # system prompt, and Anthropic's reads up to the broker's second breakpoint, after the header
        # (`providers.anthropic_translate.with_system_breakpoint`).
        merged_cached = rules.cacheable(shared + FRAMING_TOKENS + self._header) if shared else 0
        layout = MergeLayout(shared=shared, header=self._header, framing=FRAMING_TOKENS,
                             cached=merged_cached if warm else 0)
        # Alone, the first member of a cold prefix pays it in full and warms it for the others.
        members = [MemberTokens(alone_prompt=c.prompt_tokens, question=c.question_tokens, output=c.max_tokens,
                                alone_cached=min(c.prompt_tokens, cacheable if warm or i else 0))
                   for i, c in enumerate(batch)]
        sizes = []
        while members:
            decision = decide(price, members, layout, policy=self._policy, rpm_pressure=rpm_pressure)
            self.last.append(decision)
            sizes.append(decision.size)
            members = [replace(m, alone_cached=min(m.alone_prompt, cacheable)) for m in members[decision.size:]]
            layout = replace(layout, cached=merged_cached)  # whatever went first has warmed the prefix
        self._remember(model, system_prompt, price.cache, shared)
        return sizes

    def _warm(self, model: str, system_prompt: str | None, style: CacheStyle, shared: int) -> bool:
        """Whether a request with this system prompt went to the provider recently (alone or merged, the
        system prompt opens both, so either warms the provider's cache of it)."""
        cache = self._sent.get(style)
        if cache is None or not shared:
            return False
        prefix = _prefix(shared + FRAMING_TOKENS)
        return cache.lookup(_key(model, system_prompt), prefix, breakpoints=(len(prefix),)).read_tokens > 0

    def _remember(self, model: str, system_prompt: str | None, style: CacheStyle, shared: int) -> None:
        cache = self._sent.get(style)
        if cache is not None and shared:
            prefix = _prefix(shared + FRAMING_TOKENS)
            cache.record(_key(model, system_prompt), prefix, breakpoints=(len(prefix),))


def economy_for(settings: Settings, costs: CostBook, clock: Clock) -> MergeEconomy:
    """The merge decision on cost as `merge.*` configures it (`merge.policy`, the capacity rule); the header
    it prices is the one merged calls carry."""
    m = settings.merge
    return MergeEconomy(costs, policy=MergePolicy(m.capacity_merge, m.capacity_pressure, m.capacity_max_premium),
                        by_cost=m.policy == "cost", header_tokens=count_text_tokens(m.header or DEFAULT_HEADER),
                        count=count_text_tokens, clock=clock)


def _key(model: str, system_prompt: str | None) -> CacheKey:
    """Prefixes sent are known by their system prompt (the tokens after it differ per request)."""
    return CacheKey("sent", model, scope=str(hash(system_prompt)))


def _prefix(length: int) -> list[int]:
    """A stand-in token sequence for a shared prefix of `length` tokens: the key names the system prompt,
    so the cache model only needs the prefix's length."""
    return [0] * length
