"""Merged streams: the streamed members of one merged call, each fed its own block as the reply streams.

Every member is answered at once with its `MemberStream`; `StreamedMembers` feeds each one's block text
as it arrives and closes it on its verdict (`broker.engine.chat.early_release`). A member that cannot be
answered from the merged call is re-sent alone through `resend_alone(job, stream, usage)`: from the start
when none of its text was sent yet (the stream switches over, with no seam), or continued from where its
block broke off (`MemberStream.resume_with`); only a leak found after text was sent ends a stream early,
filtered. So a merged stream never ends in an error that the member's own call would not have had.

Each member's `usage` future settles for the ledger: with its share of the merged call's reported usage
(`settle_answered`), with its own call's usage when re-sent, or with what the broker counts
(`settle_rest`): a member answered by nothing else is never left open.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from mergebroker.broker.engine.chat.member_stream import MemberStream
from mergebroker.broker.engine.chat.stream_usage import settle
from mergebroker.clock import Clock
from mergebroker.errors import BrokerError
from mergebroker.merge.leak import find_leaks
from mergebroker.merge.settle import LEAK, BlockVerdict
from mergebroker.merge.stream_split import releasable
from mergebroker.token_usage import TokenUsage


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

    def close(self, verdict: BlockVerdict, usage: TokenUsage | None) -> bool:
        """The block is over (or its budget spent); False when the member is to be re-sent alone."""
        if self.stream.ended:
            return True
        if verdict.answer is not None:
            self._release(verdict.answer[self._sent:])
            self.stream.finish(verdict.finish_reason, usage)
            return True
        if verdict.reason == LEAK and self.stream.sent_text:
            self.stream.end_filtered()
            return True
        return False


ResendAlone = Callable[[Any, MemberStream, "asyncio.Future[Any]"], Awaitable[None]]
UsageFor = Callable[[str, str], TokenUsage]


class StreamedMembers:
    """The streamed members of one merged call (see the module docstring)."""

    def __init__(self, by_id: Mapping[str, Any], requests: Mapping[str, str], *, hold_words: int,
                 include_usage: Mapping[str, bool], resend_alone: ResendAlone, clock: Clock) -> None:
        self._by_id = by_id
        self._resend = resend_alone
        self._clock = clock
        self.started = clock()
        self.members = {i: StreamedMember(MemberStream(model=job.model, include_usage=include_usage[i]), i,
                                          requests, hold_words, clock) for i, job in by_id.items()}
        loop = asyncio.get_running_loop()
        self.usage: dict[str, asyncio.Future[TokenUsage]] = {i: loop.create_future() for i in by_id}
        self.resent: list[asyncio.Future[None]] = []
        self._alone: set[str] = set()  # re-sent alone: their usage comes from their own call

    def outcome_streams(self) -> dict[str, MemberStream]:
        """Each member's stream, to hand to its caller now."""
        return {i: m.stream for i, m in self.members.items()}

    def feed(self, member_id: str, text: str) -> None:
        """Text of a member's block."""
        self.members[member_id].feed(text)

    def close(self, member_id: str, verdict: BlockVerdict, usage: TokenUsage | None) -> bool:
        """The member's block is over; False when it is being re-sent alone."""
        member = self.members[member_id]
        if member.close(verdict, usage):
            return True
        self._send_alone(member_id)
        return False

    def fail_all(self, errors: Mapping[str, BrokerError]) -> None:
        """The merged call failed before its first chunk: refusals end their streams, the rest go alone."""
        for member_id, member in self.members.items():
            if member_id in errors:
                member.stream.fail(errors[member_id])
            else:
                self._send_alone(member_id)

    def _send_alone(self, member_id: str) -> None:
        self._alone.add(member_id)
        self.resent.append(asyncio.ensure_future(
            self._resend(self._by_id[member_id], self.members[member_id].stream, self.usage[member_id])))

    def settle_answered(self, usage: Mapping[str, TokenUsage]) -> None:
        """The usage of members answered from the merged call (their share of its reported usage)."""
        for member_id, value in usage.items():
            if member_id not in self._alone:
                settle(self.usage[member_id], value)

    def settle_rest(self, usage_for: UsageFor) -> None:
        """Every member not re-sent alone and not settled yet: `usage_for(member_id, text it received)`, or
        nothing for a member that received no text (its stream failed with the merged call)."""
        for member_id, future in self.usage.items():
            if member_id not in self._alone and not future.done():
                text = self.members[member_id].stream.released
                settle(future, usage_for(member_id, text) if text else TokenUsage(counted=True))

    def first_tokens(self) -> list[tuple[int, float]]:
        """(position in the batch, from 1; seconds from the call's start to its first text) per member."""
        return [(n, m.first_text_at - self.started) for n, m in enumerate(self.members.values(), 1)
                if m.first_text_at is not None]
