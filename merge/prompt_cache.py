"""A model of a provider's prompt cache: how many prompt tokens of a request it would read from cache.

Providers discount a prompt prefix they have seen recently, and the broker needs that number before it
sends anything: a member sent alone may already get its system prompt at the cached price, which is the
bill a merge has to beat. The model is deliberately simple and a little optimistic:

- "openai": every prefix of at least `min_tokens` (1,024) is cached automatically, in `step` (128) token
  increments, for `ttl_s` after its last use. A request reads the longest such prefix seen before under
  the same key. (The real cache also routes by prefix and may miss under load; this model assumes a hit.)
- "anthropic": only a prefix ending at an explicit `cache_control` breakpoint is cached (given here as a
  token offset), when at least `min_tokens` long. A request reads its longest breakpoint prefix seen
  before, and writes the tokens from there to its last breakpoint (billed at the write price). Anthropic
  also looks back a few blocks from each breakpoint; that is not modelled, so reads are underestimated.
- "none": nothing is cached.

`PrefixCache` remembers prefixes by hash only: the prompt's token ids are chained through blake2b in
128-token chunks, so a prefix is one 16-byte digest whatever its length, and the whole cache is an LRU of
at most `max_entries` digests. The key (provider, model, scope) seeds the chain, so prefixes seen under
one key never match another's; `scope` is whatever the provider shares its cache across (the upstream
account or organisation, or the tenant where each has its own key).

Its counts are the broker's own (o200k_base); `merge.calibration` scales them into the provider's.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mergebroker.clock import monotonic
from mergebroker.merge.pricing import CacheStyle

# The hash chain's chunk, independent of the provider's step, so that a prefix hashes the same whichever
# boundaries a request asks about.
_CHUNK = 128
_DIGEST = 16


@dataclass(frozen=True, slots=True)
class ProviderCacheModel:
    """The rules of one provider's prompt cache (see the module docstring for each style)."""

    style: CacheStyle = CacheStyle.OPENAI
    min_tokens: int = 1024
    step: int = 128
    ttl_s: float = 300.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "style", CacheStyle(self.style))
        if self.min_tokens < 1 or self.step < 1 or self.ttl_s <= 0:
            raise ValueError("min_tokens and step must be positive integers and ttl_s positive")

    @classmethod
    def for_style(cls, style: CacheStyle | str) -> ProviderCacheModel:
        """The documented defaults of a style: OpenAI 1,024 tokens in 128-token steps, Anthropic 1,024
        tokens at any breakpoint (2,048 for Haiku models, not distinguished here), both five minutes."""
        style = CacheStyle(style)
        if style is CacheStyle.ANTHROPIC:
            return cls(style, min_tokens=1024, step=1, ttl_s=300.0)
        return cls(style)

    def cacheable(self, prefix_tokens: int) -> int:
        """The tokens of a matching prefix of this length that the provider would bill as cached."""
        if self.style is CacheStyle.NONE or prefix_tokens < self.min_tokens:
            return 0
        return self.min_tokens + (prefix_tokens - self.min_tokens) // self.step * self.step

    def boundaries(self, length: int, breakpoints: Sequence[int] = ()) -> list[int]:
        """The prefix lengths of a `length`-token prompt that could be cached, ascending."""
        if self.style is CacheStyle.NONE:
            return []
        if self.style is CacheStyle.ANTHROPIC:
            return sorted({b for b in breakpoints if self.min_tokens <= b <= length})
        return list(range(self.min_tokens, length + 1, self.step))


@dataclass(frozen=True, slots=True)
class CacheKey:
    """Whose cache a prompt meets: the provider, the model, and the scope the provider shares it across."""

    provider: str
    model: str
    scope: str = ""


@dataclass(frozen=True, slots=True)
class CacheEstimate:
    """Prompt tokens a request would read from the provider's cache, and write to it (Anthropic only)."""

    read_tokens: int
    write_tokens: int = 0


class PrefixCache:
    """The prefixes recently sent under each key, as digests, to estimate a request's cached tokens.

    `lookup` estimates without remembering anything; `record` remembers a request that was sent (and
    refreshes the TTL of its prefixes, as a read does at the provider); `observe` does both. Bounded by
    `max_entries` digests, least recently used evicted first. Not thread-safe: use it from one thread.
    """

    def __init__(self, model: ProviderCacheModel, *, max_entries: int = 100_000,
                 clock: Callable[[], float] = monotonic) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be positive")
        self._model = model
        self._max_entries = max_entries
        self._clock = clock
        # digest -> expiry; most recently used at the end, so eviction pops from the front.
        self._expiry: OrderedDict[bytes, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._expiry)

    @property
    def min_tokens(self) -> int:
        """The shortest prompt that has a cacheable prefix: a shorter one reads and records nothing."""
        return self._model.min_tokens

    def lookup(self, key: CacheKey, tokens: Sequence[int], breakpoints: Sequence[int] = ()) -> CacheEstimate:
        """What sending `tokens` now would read from (and write to) the cache, given what was recorded."""
        offsets = self._model.boundaries(len(tokens), breakpoints)
        return self._estimate(offsets, _prefix_digests(key, tokens, offsets))

    def record(self, key: CacheKey, tokens: Sequence[int], breakpoints: Sequence[int] = ()) -> None:
        """Remember that `tokens` were sent now: each cacheable prefix lives `ttl_s` from now."""
        offsets = self._model.boundaries(len(tokens), breakpoints)
        self._remember(_prefix_digests(key, tokens, offsets))

    def observe(self, key: CacheKey, tokens: Sequence[int], breakpoints: Sequence[int] = ()) -> int:
        """`lookup(...).read_tokens` for a request that is being sent, which is then recorded."""
        offsets = self._model.boundaries(len(tokens), breakpoints)
        digests = _prefix_digests(key, tokens, offsets)
        estimate = self._estimate(offsets, digests)
        self._remember(digests)
        return estimate.read_tokens

    def _estimate(self, offsets: list[int], digests: list[bytes]) -> CacheEstimate:
        now = self._clock()
        read = 0
        for offset, digest in zip(reversed(offsets), reversed(digests)):
            expires = self._expiry.get(digest)
            if expires is not None and expires > now:
                read = self._model.cacheable(offset)
                break
        write = offsets[-1] - read if self._model.style is CacheStyle.ANTHROPIC and offsets else 0
        return CacheEstimate(read_tokens=read, write_tokens=max(0, write))

    def _remember(self, digests: list[bytes]) -> None:
        expires = self._clock() + self._model.ttl_s
        # Longest first, so the short prefixes that other requests share are the last to be evicted.
        for digest in reversed(digests):
            self._expiry[digest] = expires
            self._expiry.move_to_end(digest)
        while len(self._expiry) > self._max_entries:
            self._expiry.popitem(last=False)


def _prefix_digests(key: CacheKey, tokens: Sequence[int], offsets: Sequence[int]) -> list[bytes]:
    """The digest of `tokens[:offset]` under `key`, for each ascending offset, hashing each token once."""
    seed = f"{key.provider}\x1f{key.model}\x1f{key.scope}".encode()
    chain = hashlib.blake2b(seed, digest_size=_DIGEST, person=b"mb-prefix-key").digest()
    done = 0
    digests: list[bytes] = []
    for offset in offsets:
        while done + _CHUNK <= offset:
            chain = _chunk_digest(chain, tokens[done:done + _CHUNK], b"mb-prefix-chunk")
            done += _CHUNK
        # A prefix ending inside a chunk gets its own tail digest, so each prefix has exactly one digest.
        digests.append(chain if done == offset else _chunk_digest(chain, tokens[done:offset], b"mb-prefix-tail"))
    return digests


def _chunk_digest(chain: bytes, tokens: Sequence[int], person: bytes) -> bytes:
    # Token ids fit in 32 bits (o200k_base has about 200,000), "I" is 4 bytes on every supported platform.
    return hashlib.blake2b(chain + array("I", tokens).tobytes(), digest_size=_DIGEST, person=person).digest()
