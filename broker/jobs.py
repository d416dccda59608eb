"""The unit of work that travels from the HTTP handler through the queue to dispatch, and its outcome."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from mergebroker.broker.admission import Caller
from mergebroker.merge.shape import MergeShape


@dataclass(frozen=True)
class ChatOutcome:
    """What a caller receives: its own completion body plus how it was produced."""

    body: dict[str, Any]
    provider: str | None
    upstream_s: float
    batch_size: int = 1
    batch_id: str | None = None
    fallback: str | None = None  # why a merged member was re-sent alone, if it was


@dataclass(eq=False)
class ChatJob:
    """One admitted chat request waiting for an answer. Exactly one of result/exception is set."""

    request_id: str
    caller: Caller
    body: dict[str, Any]
    model: str
    priority: float  # rank at the upstream limiter: tier priority aged by queue time (broker.queue.aged_rank)
    shape: MergeShape | None
    merge_key: str | None
    prompt_tokens: int
    max_tokens: int
    deadline: float  # a follower joining before dispatch may extend it (broker.chat); read when sent
    enqueued_at: float
    dispatched: bool = False  # set by the dispatcher as it reads `deadline` to send
    future: asyncio.Future[ChatOutcome] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    @property
    def tier(self) -> str:
        return self.caller.tier

    def resolve(self, outcome: ChatOutcome) -> None:
        """Set the answer; safe to call twice or after the caller left."""
        if not self.future.done():
            self.future.set_result(outcome)

    def fail(self, exc: BaseException) -> None:
        """Set the error; safe to call twice or after the caller left."""
        if not self.future.done():
            self.future.set_exception(exc)
