"""Early release: a merged call requested as a stream, each member judged as soon as its block closes.

`stream_blocks` opens the merged call as a stream through the pools, reads its text as it arrives
(`providers.sse`), splits it as it grows (`merge.stream_split`) and judges every closed block by the
whole-reply rule (`merge.settle.settle_block`), handing each verdict to `on_verdict` at once, so the
dispatcher can answer that member while the upstream still writes the later blocks.

- A failure before the first chunk raises as `pools.chat` would: the caller settles it as a failed call.
- A failure mid-stream, or the merged call's deadline passing, gives every member still without a
  verdict `merged_call_failed` (re-sent alone); members already answered keep their answers.
- A member's text that goes past its own budget (`max_tokens`) ends it there at once, with "length".
- What the stream said at its end (provider, ids, finish reason, reported usage) is in the `StreamedReply`.

`CountedUsage` is a member's usage before the upstream reports any: its share of the combined prompt's
estimated tokens and the counted tokens of its own answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from mergebroker.broker.engine.ground.tokens import count_text_tokens
from mergebroker.clock import Clock
from mergebroker.errors import BrokerError
from mergebroker.merge.member_budget import BudgetWatch
from mergebroker.merge.settle import MERGED_CALL_FAILED, BlockVerdict, SettleMember, SettleOptions, settle_block
from mergebroker.merge.split import BlockFailure
from mergebroker.merge.stream_split import BlockClosed, StreamEvent, StreamSplitter
from mergebroker.merge.usage import apportion_usage
from mergebroker.providers.base import Pool
from mergebroker.providers.sse import chat_event
from mergebroker.token_usage import TokenUsage

log = structlog.get_logger(__name__)


@dataclass
class StreamedReply:
    """What a streamed merged call said besides its blocks (filled in as it streams)."""

    provider: str
    meta: dict[str, Any] = field(default_factory=dict)  # id, created, model, system_fingerprint
    finish_reason: str | None = None
    usage: TokenUsage | None = None  # as reported at the end (stream_options.include_usage)
    text: list[str] = field(default_factory=list)  # every piece of content, blocks and tags (the calibration's)
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
    (and, to `on_delta`, each piece of a block's text as it arrives).

    A member's verdict is known when its block closes, or as soon as its text goes past its own budget
    (`merge.member_budget`): it ends there with "length", whatever its block holds next.
    """
    body = {**call.body, "stream_options": {"include_usage": True}}
    chunks, provider = await pools.stream_chat(call.model, body, deadline=call.deadline, priority=call.priority,
                                               tokens=call.tokens)
    reply = StreamedReply(provider)
    splitter = StreamSplitter([m.id for m in members])
    judge = _Judge(members, options, lambda member_id, verdict: on_verdict(member_id, verdict, reply), on_delta)
    try:
        # The stream's own timeout bounds each gap between chunks; the call as a whole ends at its deadline.
        async with clock.timeout_at(call.deadline):
            async for chunk in chunks:
                event = chat_event(chunk)
                reply.meta.update(event.meta or {})
                if event.text:
                    reply.text.append(event.text)
                    judge(splitter.feed(event.text))
                reply.finish_reason = event.finish_reason or reply.finish_reason
                reply.usage = TokenUsage.from_body(event.usage) or reply.usage
    except (BrokerError, TimeoutError) as exc:
        log.warning("merged_stream_failed", size=len(members), open=len(splitter.pending), error=type(exc).__name__)
        reply.failed = True
        judge.fail(splitter.pending)
        return reply
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
    judge(splitter.finish(reply.finish_reason))
    return reply


class _Judge:
    """Turns the splitter's events into verdicts, once per member: at its block's close, or once its text
    goes past its budget; text of members still open goes to `on_delta`."""

    def __init__(self, members: Sequence[SettleMember], options: SettleOptions,
                 on_verdict: Callable[[str, BlockVerdict], None], on_delta: OnDelta | None) -> None:
        self._members = {m.id: m for m in members}
        self._requests = {m.id: m.request_text for m in members}
        self._options = options
        self._on_verdict = on_verdict
        self._on_delta = on_delta
        self._texts: dict[str, str] = {}
        self._watches = {m.id: BudgetWatch(m.max_tokens, options.count_tokens) for m in members}
        self._decided: set[str] = set()

    def __call__(self, events: list[StreamEvent]) -> None:
        for event in events:
            if event.id in self._decided:
                continue
            member = self._members[event.id]
            if isinstance(event, BlockClosed):
                self._decide(event.id, settle_block(member, event.answer, self._requests, self._options,
                                                    partial=event.partial))
                continue
            text = self._texts[event.id] = self._texts.get(event.id, "") + event.text
            if self._watches[event.id].exceeded(text.lstrip()):
                self._decide(event.id, settle_block(member, BlockFailure.TRUNCATED, self._requests, self._options,
                                                    partial=text.lstrip()))
            elif self._on_delta is not None:
                self._on_delta(event.id, event.text)

    def fail(self, pending: Sequence[str]) -> None:
        """The merged call broke off: every member still open is re-sent alone."""
        for member_id in pending:
            if member_id not in self._decided:
                self._decide(member_id, BlockVerdict(None, MERGED_CALL_FAILED))

    def _decide(self, member_id: str, verdict: BlockVerdict) -> None:
        self._decided.add(member_id)
        self._on_verdict(member_id, verdict)


class CountedUsage:
    """Members' usage from counted tokens: a share of the combined prompt's estimate, their answer's tokens."""

    def __init__(self, prompt_estimate: int, members: Sequence[SettleMember]) -> None:
        self.prompt_tokens = prompt_estimate  # the broker's count of the whole merged prompt
        self._prompt = apportion_usage(TokenUsage(prompt_estimate, counted=True),
                                       member_prompt_tokens={m.id: m.own_prompt_tokens for m in members},
                                       member_completion_weights={})

    def usage(self, member_id: str, answer: str) -> TokenUsage:
        """`member_id`'s usage answering `answer`, marked as counted by the broker."""
        return TokenUsage(self._prompt[member_id].prompt_tokens, count_text_tokens(answer), counted=True)


def settle_usage(futures: Mapping[str, asyncio.Future[TokenUsage]], usage: Mapping[str, TokenUsage]) -> None:
    """Hand each released member its final usage (the ledger waits for it); safe after cancellation."""
    for member_id, future in futures.items():
        if not future.done() and member_id in usage:
            future.set_result(usage[member_id])
