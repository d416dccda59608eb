"""The unit of work that travels from the HTTP handler through the queue to dispatch, and its outcome."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from mergebroker.broker.engine.ground.tokens import estimate_prompt_tokens
from mergebroker.broker.engine.limits.admission import Caller
from mergebroker.errors import BrokerError, Overloaded
from mergebroker.frozen_init import direct_init
from mergebroker.merge.shape import MergeShape
from mergebroker.token_usage import TokenUsage
from mergebroker.tracing import TraceContext

log = structlog.get_logger(__name__)

SendCheck = Callable[[], Awaitable[bool]]
"""`before_send()`: awaited just before a job goes upstream (`clear_to_send`); True lets it go. False means
it must not go: whoever set the hook answers for the job (or knows nobody is waiting for it here)."""


def aged_rank(priority: int, enqueued_at: float, aging_per_s: float) -> float:
    """A time-invariant rank with the same order as `priority + aging_per_s * (now - enqueued_at)` at any `now`.

    Waiters that are ordered once (the upstream limiter's heap) keep the aging bound this way: a request
    that has waited (p_high - p_low) / aging_per_s longer outranks a fresh higher-priority one.
    """
    if aging_per_s <= 0:
        return float(priority)
    return priority / aging_per_s - enqueued_at


@direct_init  # built on every request
@dataclass(frozen=True)
class ChatOutcome:
    """What a caller receives: its own completion body plus how it was produced."""

    body: dict[str, Any]
    provider: str | None
    upstream_s: float
    batch_size: int = 1
    batch_id: str | None = None
    fallback: str | None = None  # why a merged member was re-sent alone, if it was
    # Known later, and the ledger waits for it (`RequestInfo.usage_settles`): released early (before the
    # merged reply ended), the member's share of the provider's report (the body's is counted); a stream, its
    # usage once it ends (the provider's, or counted).
    settled_usage: asyncio.Future[TokenUsage] | None = field(default=None, compare=False, repr=False)
    # A streaming request's answer: SSE event bytes to relay (its own upstream stream, or its block of a
    # merged one, `broker.engine.chat.member_stream`); `body` is empty then.
    stream: AsyncIterable[bytes] | None = field(default=None, compare=False, repr=False)
    # The body's usage, read once here so nothing parses it back out of the JSON (None: none reported).
    usage: TokenUsage | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.usage is None and self.body:
            object.__setattr__(self, "usage", TokenUsage.from_body(self.body))


@dataclass(eq=False)
class ChatJob:
    """One admitted chat request waiting for an answer. Exactly one of result/exception is set."""

    request_id: str
    caller: Caller
    body: dict[str, Any]
    model: str
    priority: float  # rank at the upstream limiter: tier priority aged by queue time (aged_rank)
    shape: MergeShape | None
    merge_key: str | None
    prompt_tokens: int | None  # the prompt's estimated tokens; None until something needs them (`counted_prompt`)
    max_tokens: int
    deadline: float  # only `extend_deadline` changes it, and only until `mark_sent`
    enqueued_at: float
    dispatched: bool = False  # only `mark_sent` sets it
    stream: bool = False  # a streaming request (merged streams): its outcome carries a stream
    future: asyncio.Future[ChatOutcome] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    before_send: SendCheck | None = field(default=None, compare=False, repr=False)  # cluster: the sent marker
    trace_context: TraceContext | None = field(default=None, compare=False, repr=False)  # its request's span

    @property
    def tier(self) -> str:
        return self.caller.tier

    def counted_prompt(self) -> int:
        """The prompt's estimated tokens, counted the first time something needs them (merge planning, an
        upstream's token limit, the cluster's wire, a stream whose upstream reports no usage)."""
        if self.prompt_tokens is None:
            self.prompt_tokens = estimate_prompt_tokens(self.body.get("messages") or [])
        return self.prompt_tokens

    @property
    def reserved_tokens(self) -> int:
        """What the job may cost at most: its estimated prompt plus its output budget."""
        prompt = self.prompt_tokens  # asked for every call: the count made already, without a call
        return (self.counted_prompt() if prompt is None else prompt) + self.max_tokens

    def extend_deadline(self, deadline: float) -> bool:
        """Let the job run until the later `deadline` (a coalesced follower's); False once it was sent."""
        if self.dispatched:
            return False
        self.deadline = max(self.deadline, deadline)
        return True

    def mark_sent(self) -> float:
        """Freeze the deadline as the job goes upstream; returns the deadline the call runs under."""
        self.dispatched = True
        return self.deadline

    def resolve(self, outcome: ChatOutcome) -> None:
        """Set the answer; safe to call twice or after the caller left."""
        if not self.future.done():
            self.future.set_result(outcome)

    def fail(self, exc: BaseException) -> None:
        """Set the error; safe to call twice or after the caller left."""
        if not self.future.done():
            self.future.set_exception(exc)


async def answer_all(jobs: list[ChatJob], work: Awaitable[None]) -> None:
    """Await `work`, then make sure no job of `jobs` is left without an answer, whatever happened."""
    try:
        await work
    except asyncio.CancelledError:  # the worker is stopping: the broker is shutting down
        fail_unanswered(jobs, Overloaded("The broker is shutting down.", retry_after=1))
        raise
    except Exception as exc:  # noqa: BLE001 - a bug must still answer every caller, at once
        log.exception("dispatch_failed", size=len(jobs), error=type(exc).__name__)
        fail_unanswered(jobs, exc if isinstance(exc, BrokerError) else BrokerError(
            f"The broker failed while dispatching the request ({type(exc).__name__}).", status=500,
            code="dispatch_failed"))
    else:
        if any(not j.future.done() for j in jobs):  # the error is built only when needed (rarely)
            fail_unanswered(jobs, BrokerError("The broker lost track of the request.", status=500,
                                               code="dispatch_failed"))
            log.error("dispatch_left_jobs_unanswered", size=len(jobs))


async def clear_to_send(jobs: list[ChatJob]) -> list[ChatJob]:
    """The jobs that may go upstream now, in order: each job not yet sent that has a `before_send` hook is
    asked (all together); a job it refuses, or whose hook fails, is cancelled and left out, and so is a job
    whose caller left while the hooks ran. Jobs without a hook pass at no cost."""
    asking = [j for j in jobs if j.before_send is not None and not j.dispatched]
    if not asking:
        return jobs
    verdicts = await asyncio.gather(*(j.before_send() for j in asking if j.before_send), return_exceptions=True)
    for job, verdict in zip(asking, verdicts):
        if verdict is not True:
            if isinstance(verdict, BaseException):
                log.error("before_send_failed", request_id=job.request_id, error=repr(verdict))
            job.future.cancel()  # safe when its hook's owner already cancelled it
    return [j for j in jobs if not j.future.done()]


def fail_unanswered(jobs: list[ChatJob], exc: BrokerError) -> int:
    """Fail the jobs still waiting; how many there were."""
    waiting = [j for j in jobs if not j.future.done()]
    for job in waiting:
        job.fail(exc)
    return len(waiting)
