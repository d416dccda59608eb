"""A request sent to an upstream that speaks its API natively: the body as sent, through the same door.

Native calls are never merged or cached (agent traffic: tools, state, encrypted reasoning), but they
are admitted like chat: the tier's and the key's RPM/TPM limits reserve the prompt estimate plus the
output budget, a fast "busy" answer comes while every upstream of the model is open, and the pools'
retries, failover and breakers apply. The reservation is settled with the usage the upstream reports.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mergebroker.broker.engine.accounting.request_record import RequestInfo, note_usage
from mergebroker.broker.engine.chat.jobs import aged_rank
from mergebroker.broker.engine.chat.service import ChatService
from mergebroker.broker.engine.ground.settings import Settings
from mergebroker.broker.engine.limits.admission import Caller
from mergebroker.broker.engine.limits.ratelimit import Reservation
from mergebroker.broker.engine.streams import HandledStream, Relay
from mergebroker.clock import Clock
from mergebroker.errors import DeadlineExceeded
from mergebroker.providers.pool import ProviderPools
from mergebroker.token_usage import TokenUsage


@dataclass(frozen=True)
class NativeRequest:
    """One native call: the API, the body to send, the caller's forwarded headers, and the chat form of
    the same request (what the limits estimate its prompt and output budget from)."""

    api: str
    body: dict[str, Any]
    headers: Mapping[str, str]
    chat_form: dict[str, Any]
    timeout_s: float | None = None


class NativeCalls:
    """Sends native requests through the pools with the chat path's admission (see the module docstring)."""

    def __init__(self, settings: Settings, chat: ChatService, pools: ProviderPools, clock: Clock) -> None:
        self._settings = settings
        self._tiers = {t.name: t for t in settings.tiers}
        self._chat = chat
        self._pools = pools
        self._clock = clock

    def _call_terms(self, caller: Caller, request: NativeRequest) -> tuple[float, float]:
        tier = self._tiers[caller.tier]
        deadline = self._clock() + tier.timeout_for(request.timeout_s)
        return deadline, aged_rank(tier.priority, self._clock(), self._settings.server.aging_per_s)

    async def complete(self, info: RequestInfo, caller: Caller,
                       request: NativeRequest) -> tuple[dict[str, Any], dict[str, str]]:
        """The upstream's JSON answer and the broker's headers for it; its usage noted in `info`, the
        reservation settled with it."""
        reply, reservation, spent = await self._send(info, caller, request, self._pools.native,
                                                     "The request did not complete within its deadline.")
        usage = TokenUsage.from_body(reply)
        note_usage(info, usage)
        await reservation.settle(usage.total_tokens if usage else spent)
        return reply, {**_ALONE, **reservation.headers()}

    async def stream(self, info: RequestInfo, caller: Caller, request: NativeRequest,
                     relay: Callable[[], Relay]) -> HandledStream:
        """The upstream's own stream, relayed through `relay()` (which reads its usage as it passes)."""
        chunks, reservation, _ = await self._send(info, caller, request, self._pools.stream_native,
                                                  "The stream did not start within its deadline.")
        return HandledStream(info, _iterate(chunks), reservation, relay(), headers=dict(_ALONE))

    async def _send(self, info: RequestInfo, caller: Caller, request: NativeRequest,
                    send: Callable[..., Awaitable[Any]], late: str) -> tuple[Any, Reservation, int]:
        """Admit `request` (fast "busy" while every upstream is open; the limits reserve its estimate and
        output budget) and `send` it through the pools before its deadline: what the pool answered, the
        reservation to settle, and the tokens reserved. A failure settles the reservation at nothing."""
        deadline, priority = self._call_terms(caller, request)
        model = request.body["model"]
        self._chat.check_fast_fail(model)
        reservation, prompt_tokens, max_tokens = await self._chat.admit(caller, request.chat_form)
        spent = prompt_tokens + max_tokens
        started = time.perf_counter()
        try:
            async with self._clock.timeout_at(deadline):
                answer, provider = await send(model, request.api, request.body, headers=request.headers,
                                              deadline=deadline, priority=priority, tokens=spent,
                                              tenant=caller.tenant)
        except TimeoutError:
            await reservation.settle(0)
            raise DeadlineExceeded(late) from None
        except BaseException:
            await reservation.settle(0)
            raise
        info.upstream_s, info.provider, info.batch_size, info.cache = time.perf_counter() - started, provider, 1, "miss"
        info.alone_prompt_tokens = prompt_tokens
        return answer, reservation, spent


_ALONE = {"X-Broker-Batch-Size": "1", "X-Broker-Cache": "miss"}  # never merged, never cached


async def _iterate(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """`chunks` as a generator that closes them when it is closed."""
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()
