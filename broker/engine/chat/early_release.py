"""Early release: a merged call requested as a stream, each member judged as soon as its block closes.

`stream_blocks` opens the merged call as a stream through the pools, reads its text as it arrives
(`providers.sse`), splits it as it grows (`merge.stream_split`) and judges every closed block by the
whole-reply rule (`merge.settle.settle_block`), handing each verdict to `on_verdict` at once, so the
dispatcher can answer that member while the upstream still writes the later blocks.

- A failure before the first chunk raises as `pools.chat` would: the caller settles it as a failed call.
- A failure mid-stream, or the merged call's deadline passing, gives every member still without a
  verdict `merged_call_failed` (re-sent alone); members already answered keep their answers.
- What the stream said at its end (provider, ids, finish reason, reported usage) is in the `StreamedReply`.

`CountedUsage` is a member's usage before the upstream reports any: its share of the combined prompt's
estimated tokens and the counted tokens of its own answer.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping, Sequence

import structlog

from mergebroker.broker.engine.tokens import count_text_tokens
from mergebroker.clock import Clock
from mergebroker.errors import BrokerError
from mergebroker.broker.engine.chat.member_stream import MemberStream
from mergebroker.merge.leak import find_leaks
from mergebroker.merge.settle import (LEAK, MERGED_CALL_FAILED, BlockVerdict, SettleMember, SettleOptions,
                                      settle_block)
from mergebroker.merge.stream_split import BlockClosed, StreamEvent, StreamSplitter, releasable
from mergebroker.merge.usage import apportion_usage
from mergebroker.providers.base import Pool
from mergebroker.providers.sse import chat_event

log = structlog.get_logger(__name__)


@dataclass
class StreamedReply:
    """What a streamed merged call said besides its blocks (filled in as it streams)."""

    provider: str
    meta: dict[str, Any] = field(default_factory=dict)  # id, created, model, system_fingerprint
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None  # as reported at the end (stream_options.include_usage)
    failed: bool = False  # ended by an error or the deadline: open members got `merged_call_failed`


OnVerdict = Callable[[str, BlockVerdict, StreamedReply], None]
OnDelta = Callable[[str, str], None]


@dataclass(frozen=True)
class StreamCall:
    """One streamed merged call: where it goes and how long it may take."""

    model: str
    body: dict[str, Any]
    deadline: float
    priority: float
    tokens: int
    stream: bool = False  # its members are streaming requests (merged streams)


async def stream_blocks(pools: Pool, call: StreamCall, members: Sequence[SettleMember],
                        options: SettleOptions, on_verdict: OnVerdict, *, clock: Clock,
                        on_delta: OnDelta | None = None) -> StreamedReply:
    """Run `call` as a stream and hand each member's verdict to `on_verdict` as soon as it is known
    (and, to `on_delta`, each piece of a block's text as it arrives)."""
    body = {**call.body, "stream_options": {"include_usage": True}}
    chunks, provider = await pools.stream_chat(call.model, body, deadline=call.deadline, priority=call.priority,
                                               tokens=call.tokens)
    reply = StreamedReply(provider)
    splitter = StreamSplitter([m.id for m in members])
    requests = {m.id: m.request_text for m in members}

    def judge(events: list[StreamEvent]) -> None:
        for event in events:
            if isinstance(event, BlockClosed):
                on_verdict(event.id, settle_block(event.id, event.answer, requests, options), reply)
            elif on_delta is not None:
                on_delta(event.id, event.text)

    try:
        # The stream's own timeout bounds each gap between chunks; the call as a whole ends at its deadline.
        async with clock.timeout_at(call.deadline):
            async for chunk in chunks:
                event = chat_event(chunk)
                reply.meta.update(event.meta or {})
                if event.text:
                    judge(splitter.feed(event.text))
                reply.finish_reason = event.finish_reason or reply.finish_reason
                reply.usage = event.usage or reply.usage
    except (BrokerError, TimeoutError) as exc:
        log.warning("merged_stream_failed", size=len(members), open=len(splitter.pending), error=type(exc).__name__)
        reply.failed = True
        for member_id in splitter.pending:
            on_verdict(member_id, BlockVerdict(None, MERGED_CALL_FAILED), reply)
        return reply
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
    judge(splitter.finish(reply.finish_reason))
    return reply


class CountedUsage:
    """Members' usage from counted tokens: a share of the combined prompt's estimate, their answer's tokens."""

    def __init__(self, prompt_estimate: int, members: Sequence[SettleMember]) -> None:
        own = {m.id: m.own_prompt_tokens for m in members}
        self._prompt = apportion_usage({"prompt_tokens": prompt_estimate},
                                       shared_prompt_tokens=max(0, prompt_estimate - sum(own.values())),
                                       member_prompt_tokens=own, member_completion_weights={})

    def usage(self, member_id: str, answer: str) -> dict[str, int]:
        """The usage object of `member_id` answering `answer`."""
        prompt = self._prompt[member_id]["prompt_tokens"]
        completion = count_text_tokens(answer)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def settle_usage(futures: Mapping[str, asyncio.Future[dict[str, int]]], usage: Mapping[str, dict[str, int]]) -> None:
    """Hand each released member its final usage (the ledger waits for it); safe after cancellation."""
    for member_id, future in futures.items():
        if not future.done() and member_id in usage:
            future.set_result(usage[member_id])


class StreamedMember:
    """Feeds one streamed member's `MemberStream` from its block as the merged reply streams.

    Text is held back by `hold_words` words (`merge.stream_split.releasable`) and the leak check runs
    on everything received before any of it is released, so a quote of `hold_words` words of another
    member's request is caught before it could leave; a leak found mid-stream ends the member's stream
    with `content_filter`.
    """

    def __init__(self, stream: MemberStream, member_id: str, requests: Mapping[str, str], hold_words: int,
                 clock: Clock) -> None:
        self.stream = stream
        self.first_text_at: float | None = None  # when its first text was released (time to first token)
        self._clock = clock
        self._id = member_id
        self._requests = requests
        self._hold = hold_words
        self._raw = ""
        self._sent = 0  # characters of the (left-stripped) block text released so far

    def feed(self, text: str) -> None:
        """New text of the member's block."""
        if self.stream.ended:
            return
        self._raw += text
        body = self._raw.lstrip()
        if find_leaks({self._id: body}, self._requests, min_words=self._hold):
            self.stream.end_filtered()
            return
        cut = releasable(body, self._hold)
        if cut > self._sent:
            self._release(body[self._sent:cut])
            self._sent = cut

    def _release(self, text: str) -> None:
        if text and self.first_text_at is None:
            self.first_text_at = self._clock()
        self.stream.release(text)

    def close(self, verdict: BlockVerdict, usage: dict[str, int] | None) -> bool:
        """The block is over; False when the member should be re-sent alone (nothing of it was sent yet)."""
        if self.stream.ended:
            return True
        if verdict.answer is not None:
            self._release(verdict.answer[self._sent:])
            self.stream.finish("stop", usage)
        elif not self.stream.sent_text:
            return False
        elif verdict.reason == LEAK:
            self.stream.end_filtered()
        else:
            self.stream.fail(BrokerError(f"The merged answer broke off ({verdict.reason}).", status=502,
                                         code="merged_stream_failed"))
        return True


ResendAlone = Callable[[Any, MemberStream], Awaitable[None]]


class StreamedMembers:
    """The streamed members of one merged call: each job answered at once with its `MemberStream`, fed as
    the reply streams; a member whose block fails before any of its text left is re-sent alone through
    `resend_alone(job, stream)`, which switches the same stream over (no seam for the client)."""

    def __init__(self, by_id: Mapping[str, Any], requests: Mapping[str, str], *, hold_words: int,
                 include_usage: Mapping[str, bool], resend_alone: ResendAlone, clock: Clock) -> None:
        self._by_id = by_id
        self._resend = resend_alone
        self._clock = clock
        self.started = clock()
        self.members = {i: StreamedMember(MemberStream(model=job.model, include_usage=include_usage[i]), i,
                                          requests, hold_words, clock) for i, job in by_id.items()}
        self.resent: list[asyncio.Future[None]] = []

    def outcome_streams(self) -> dict[str, MemberStream]:
        """Each member's stream, to hand to its caller now."""
        return {i: m.stream for i, m in self.members.items()}

    def feed(self, member_id: str, text: str) -> None:
        """Text of a member's block."""
        self.members[member_id].feed(text)

    def close(self, member_id: str, verdict: BlockVerdict, usage: dict[str, int] | None) -> bool:
        """The member's block is over; False when it is being re-sent alone."""
        member = self.members[member_id]
        if member.close(verdict, usage):
            return True
        self.resent.append(asyncio.ensure_future(self._resend(self._by_id[member_id], member.stream)))
        return False

    def fail_all(self, errors: Mapping[str, BrokerError]) -> None:
        """The merged call failed before its first chunk: refusals end their streams, the rest go alone."""
        for member_id, member in self.members.items():
            if member_id in errors:
                member.stream.fail(errors[member_id])
            else:
                self.resent.append(asyncio.ensure_future(self._resend(self._by_id[member_id], member.stream)))

    def first_tokens(self) -> list[tuple[int, float]]:
        """(position in the batch, from 1; seconds from the call's start to its first text) per member."""
        return [(n, m.first_text_at - self.started) for n, m in enumerate(self.members.values(), 1)
                if m.first_text_at is not None]
