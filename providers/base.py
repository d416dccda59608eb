"""The provider seam: what the broker needs from one upstream, whatever speaks behind it.

A provider is one upstream endpoint (one base URL, one key). Pools (`providers.pool`) choose
among several providers serving a model; breakers and retries wrap the calls made here.
Implementations raise only `broker.errors.UpstreamError` subclasses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol

import numpy as np


class Provider(Protocol):
    """One upstream endpoint presented as the OpenAI chat and embeddings API (whatever it speaks on the wire).

    Contract:
    - `chat` posts a chat-completions body (already stripped of broker-only fields) and returns the
      parsed JSON body of a 2xx answer; any other outcome raises an `UpstreamError` subclass
      (`UpstreamHTTPError` with the upstream status and Retry-After, `UpstreamTimeout`,
      `UpstreamConnectionError`, `UpstreamBadResponse`). It makes exactly one attempt: retries,
      failover and breakers live outside.
    - `stream_chat` yields OpenAI `chat.completion.chunk` SSE events (each ending in a blank line,
      `data: [DONE]` last) after a 2xx status: as the upstream sent them, or translated from its own
      protocol; errors before the first byte raise like `chat`.
    - `embeddings` behaves like `chat` for `/embeddings`.
    - `timeout` is the whole-call budget in seconds.
    """

    name: str

    async def chat(self, body: dict[str, Any], *, timeout: float) -> dict[str, Any]: ...

    def stream_chat(self, body: dict[str, Any], *, timeout: float) -> AsyncIterator[bytes]: ...

    async def embeddings(self, body: dict[str, Any], *, timeout: float) -> dict[str, Any]: ...

    async def list_models(self, *, timeout: float) -> list[str]: ...

    async def warm_up(self, connections: int) -> None: ...

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class EmbedResult:
    """Vectors in input order (read-only arrays when they come from the batcher) and their usage.

    `cached` counts inputs answered from a cache, `coalesced` inputs that shared a text already
    pending (another caller's, or an earlier duplicate in the same request); a backend leaves both 0.
    """

    vectors: list[np.ndarray]
    prompt_tokens: int
    cached: int = 0
    coalesced: int = 0
