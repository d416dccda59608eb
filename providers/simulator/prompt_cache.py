"""The simulated upstream's automatic prompt cache, kept the way OpenAI describes its own.

A prompt prefix of at least `MIN_TOKENS` (1,024) tokens is cached in `STEP` (128) token increments, for
a TTL after its last use: a request reads the longest prefix it shares with a prompt seen before (its
`cached_tokens`), then every cacheable prefix of its own prompt is written or refreshed. Caches are
separate per scope (an API key, or one global scope), as providers never share a cache across accounts.
The TTL is read at each call, so changing it at run time applies to prefixes already cached.
Two requests in flight at once with the same new prefix both miss, as they do at a provider.

Prefixes are remembered by hash only: the prompt's token ids (`content.prompt_token_ids`, the
simulator's own tokenization) are chained through blake2b from one boundary to the next, seeded with
the scope, so a prefix of any length is one 16-byte digest, a key is never stored, and memory is bounded:
expired digests are dropped, and at most `max_entries` are kept (the least recently used go first).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from mergebroker.clock import Clock, monotonic

MIN_TOKENS = 1024
STEP = 128
MAX_ENTRIES = 100_000
_DIGEST = 16


def prefix_digests(scope: str, token_ids: Sequence[int], *, min_tokens: int = MIN_TOKENS,
                   step: int = STEP) -> list[tuple[int, bytes]]:
    """(length, digest) of every cacheable prefix of `token_ids`, shortest first.

    Equal prefixes under the same scope have equal digests; any other scope gives other digests.
    """
    return chained_digests(scope, token_ids, range(min_tokens, len(token_ids) + 1, step))


def chained_digests(scope: str, token_ids: Sequence[int], ends: Iterable[int]) -> list[tuple[int, bytes]]:
    """(length, digest) of the prefixes of `token_ids` ending at `ends` (ascending), each digest chained from
    the one before, seeded with `scope`."""
    # Token ids fit in 32 bits (o200k_base has about 200,000); "I" is 4 bytes on every supported platform.
    ids = token_ids if isinstance(token_ids, array) and token_ids.typecode == "I" else array("I", token_ids)
    data, width = memoryview(ids).cast("B"), ids.itemsize
    digests: list[tuple[int, bytes]] = []
    state = hashlib.blake2b(scope.encode(), digest_size=_DIGEST, person=b"sim-prompt").digest()
    start = 0
    for end in ends:
        chunk = hashlib.blake2b(state, digest_size=_DIGEST)
        chunk.update(data[start * width:end * width])
        state = chunk.digest()
        digests.append((end, state))
        start = end
    return digests


class PromptCache:
    """The prefixes seen recently, per scope, with the time each was last used (on the injected clock)."""

    def __init__(self, clock: Clock = monotonic, *, max_entries: int = MAX_ENTRIES, min_tokens: int = MIN_TOKENS,
                 step: int = STEP) -> None:
        self._clock = clock
        self._max_entries = max_entries
        self._min_tokens = min_tokens
        self._step = step
        self._last_used: OrderedDict[bytes, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._last_used)

    def use(self, scope: str, token_ids: Sequence[int], ttl_s: float) -> int:
        """The prompt's cached tokens (its longest prefix still cached under `scope`, else 0); then
        its own prefixes are cached from now for `ttl_s`."""
        return self.use_prefixes(prefix_digests(scope, token_ids, min_tokens=self._min_tokens, step=self._step),
                                 ttl_s)

    def use_prefixes(self, prefixes: Sequence[tuple[int, bytes]], ttl_s: float) -> int:
        """The length of the longest of `prefixes` ((length, digest), shortest first) still cached; then all
        of them are cached from now for `ttl_s` (the Anthropic mode's breakpoint cache digests its own)."""
        now = self._clock()
        cached = next((length for length, digest in reversed(prefixes)
                       if now - self._last_used.get(digest, -float("inf")) < ttl_s), 0)
        for _, digest in prefixes:
            self._last_used[digest] = now
            self._last_used.move_to_end(digest)
        # Oldest first: expired prefixes and any beyond the bound leave from the front.
        while self._last_used and (len(self._last_used) > self._max_entries
                                   or now - next(iter(self._last_used.values())) >= ttl_s):
            self._last_used.popitem(last=False)
        return cached

    def clear(self) -> None:
        """Forget every prefix."""
        self._last_used.clear()
