"""The simulated Anthropic prompt cache: explicit `cache_control` breakpoints, the way Anthropic describes its own.

A request is read in Anthropic's order (tools, then system, then messages), block by block, as token ids
(`content.token_ids`, the simulator's o200k_base tokenization; a message starts with a marker of its role).
A block carrying `cache_control` ends a breakpoint prefix. A call reads the longest of its breakpoint
prefixes still cached under its scope and model (`cache_read_input_tokens`) and writes every longer one
of at least the model's minimum (1,024 tokens, 2,048 for Haiku models): `cache_creation_input_tokens` is
from the prefix read (or the start) to its last such breakpoint. A prefix lives `ttl_s` after its last
use. Anthropic also looks back up to 20 blocks before a breakpoint for an earlier cached prefix; that is
not simulated, so only exact breakpoint prefixes hit.

Prefixes are remembered by hash only, chained through blake2b from one breakpoint to the next, seeded
with the scope and model, so a prefix of any length is one 16-byte digest and never a stored prompt.
"""

from __future__ import annotations

import json
import zlib
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mergebroker.clock import Clock, monotonic
from mergebroker.providers.simulator.content import token_ids
from mergebroker.providers.simulator.prompt_cache import PromptCache, chained_digests


def min_cacheable_tokens(model: str) -> int:
    """The shortest prefix Anthropic caches for `model`."""
    return 2048 if "haiku" in model.lower() else 1024


@dataclass(frozen=True)
class CacheUse:
    """What one call read from the cache and wrote to it, in tokens."""

    read: int = 0
    written: int = 0


def breakpoint_prompt(body: Mapping[str, Any]) -> tuple[array, list[int]]:
    """The request's token ids in Anthropic's order, and the length of the prefix each breakpoint ends."""
    ids = array("I")
    ends: list[int] = []

    def add(block: Any) -> None:
        if isinstance(block, dict):
            text = block.get("text") if block.get("type") == "text" else None
            rest = {k: v for k, v in block.items() if k != "cache_control"}
            ids.extend(token_ids(text if isinstance(text, str) else json.dumps(rest, sort_keys=True)))
            if block.get("cache_control"):
                ends.append(len(ids))
        elif isinstance(block, str):
            ids.extend(token_ids(block))

    for tool in body.get("tools") or []:
        add(tool)
    system = body.get("system")
    for block in [system] if isinstance(system, str) else system or []:
        add(block)
    for message in body.get("messages") or []:
        ids.append(zlib.crc32(str(message.get("role")).encode()))
        content = message.get("content")
        for block in [content] if isinstance(content, str) else content or []:
            add(block)
    return ids, ends


class BreakpointCache:
    """The breakpoint prefixes seen recently, per scope and model, with the time each was last used."""

    def __init__(self, clock: Clock = monotonic) -> None:
        self._prefixes = PromptCache(clock)  # its TTL and LRU bookkeeping, over digests of breakpoint prefixes

    def use(self, scope: str, body: Mapping[str, Any], ttl_s: float) -> CacheUse:
        """Read the longest cached breakpoint prefix of `body`, write the longer ones (see the module docstring)."""
        model = str(body.get("model") or "")
        ids, ends = breakpoint_prompt(body)
        eligible = sorted({end for end in ends if end >= min_cacheable_tokens(model)})
        if not eligible:
            return CacheUse()
        read = self._prefixes.use_prefixes(chained_digests(f"anthropic\0{scope}\0{model}", ids, eligible), ttl_s)
        return CacheUse(read=read, written=eligible[-1] - read)

    def clear(self) -> None:
        """Forget every prefix."""
        self._prefixes.clear()
