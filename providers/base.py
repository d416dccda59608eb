"""The provider seam: what the broker needs from one upstream, whatever speaks behind it.

A provider is one upstream endpoint (one base URL, one key). Pools (`providers.pool`) choose
among several providers serving a model; breakers and retries wrap the calls made here. `Pool` is
the pools as the chat path sees them. Fakes of both: `providers.fake`.
Implementations raise only `broker.errors.UpstreamError` subclasses.
"""

from __future__ import annotations

import contextvars
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

still_wanted: contextvars.ContextVar[Callable[[], bool] | None] = contextvars.ContextVar("still_wanted", default=None)
"""Set by a caller that may stop waiting: `still_wanted()` is False once nobody wants the call's result.
A backend that queues its work (the local model) reads it when the call is queued and skips the call if
nobody wants it by the time its turn comes; others may ignore it."""


class Provider(Protocol):
    """One upstream endpoint presented as the OpenAI chat and embeddings API (whatever it speaks on the wire).

    Contract:
    - `chat` posts a chat-completions body (already stripped of broker-only fields) and returns the
      parsed JSON body of a 2xx answer; any other outcome raises an `UpstreamError` subclass
      (`UpstreamHTTPError` with the upstream status and Retry-After, `UpstreamTimeout`,
      `UpstreamConnectionError`, `UpstreamBadResponse`). It makes exactly one attempt: retries,
      failover and breakers live outside.
    - `stream_chat` yields OpenAI `chat.completion.chunk` SSE events (each ending in a blank line,
      `data: [DONE]` last) after a 2xx status: as the upstream sent them, translated from its own
      protocol, or replayed from a whole reply when the upstream answered the stream with a JSON body
      (`providers.whole_reply`); errors before the first byte raise like `chat`.
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


class Pool(Protocol):
    """The provider pools as the chat path (`broker.engine.chat.service`, `broker.engine.chat.dispatch`) sees them.

    Real: `providers.pool.ProviderPools`; fake: `providers.fake.FakePool`.
    Contract:
    - `chat` returns `(reply body, provider name)` from some upstream serving `model`, retrying and
      failing over inside, or raises a `BrokerError`: `NotFound` for a model nobody serves,
      `UpstreamUnavailable` when every upstream of it is open, `DeadlineExceeded` when `deadline` (on
      the injected clock) passes first, else the last `UpstreamError`. `priority` ranks the call among
      those waiting for provider pacing; `tokens` is the estimate taken from the provider's budget;
      `tenant` is whom the call is for (None: several or unknown), for the breakers' blame rule.
    - `stream_chat` does the same for a stream: failover happens before the first byte; it returns the
      raw SSE chunks and the provider name.
    - `fast_fail_after(model)`: seconds until the next probe when every upstream of `model` is open
      (the caller is refused at once), else None.
    - `streams_merged(model)`: whether merged calls for `model` may be requested as streams (early
      release), i.e. every upstream that could take the call streams.
    - `limits_tokens(model)`: whether some upstream of `model` declares a token rate, so that `tokens`
      matters (0 is passed otherwise, and the caller need not count its prompt for the call).
    """

    def fast_fail_after(self, model: str) -> float | None: ...

    def rpm_pressure(self, model: str) -> float: ...

    def streams_merged(self, model: str) -> bool: ...

    def limits_tokens(self, model: str) -> bool: ...

    async def chat(self, model: str, body: dict[str, Any], *, deadline: float, priority: float = 0,
                   tokens: int = 0, tenant: str | None = None) -> tuple[dict[str, Any], str]: ...

    async def stream_chat(self, model: str, body: dict[str, Any], *, deadline: float, priority: float = 0,
                          tokens: int = 0, tenant: str | None = None) -> tuple[AsyncIterator[bytes], str]: ...


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
