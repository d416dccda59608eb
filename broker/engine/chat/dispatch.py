"""Dispatch a released group: plan batches, send single or merged calls, carry out each settlement.

Deciding is apart (`broker.engine.chat.planning` plans batches over `merge.grouping`; `merge.merged_call`
builds each merged call, as bulk jobs and `mergebroker eval` build theirs; `merge.settle` settles a merged
reply: split, leak checks, stop sequences, each member's own budget, usage, fallback reasons); this module
only acts: it sends each batch through the provider pools and executes the `Settlement`, so every member
gets exactly one outcome. A member whose block is missing, broken, or leaks another member's text is re-sent
alone within its own deadline; a merged call that fails, or whose reply cannot be read, re-sends all its
members alone. Whatever goes wrong, no member's future is left unset (`jobs.answer_all`).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any

import structlog

from mergebroker import tracing
from mergebroker.broker.engine.accounting.merge_economy import MergeEconomy
from mergebroker.broker.engine.chat.counters import DispatchCounters
from mergebroker.broker.engine.chat.early_release import (
    CountedUsage,
    StreamCall,
    StreamedReply,
    settle_usage,
    stream_blocks,
)
from mergebroker.broker.engine.chat.jobs import ChatJob, ChatOutcome, answer_all, clear_to_send
from mergebroker.broker.engine.chat.member_stream import MemberStream
from mergebroker.broker.engine.chat.merge_queue import ReleasedGroup
from mergebroker.broker.engine.chat.planning import BatchPlanner, MergeOptions, TierMergePolicy
from mergebroker.broker.engine.chat.stream_usage import (
    MeteredStream,
    caller_wants_usage,
    counted_usage,
    with_usage_requested,
)
from mergebroker.broker.engine.chat.stream_usage import settle as settle_future
from mergebroker.broker.engine.chat.streamed_members import StreamedMembers
from mergebroker.broker.engine.ground.logging import bind_log_context, unbind_log_context
from mergebroker.broker.engine.ground.metrics import Metrics
from mergebroker.broker.engine.ground.tokens import count_text_tokens, estimate_prompt_tokens
from mergebroker.clock import Clock, monotonic
from mergebroker.errors import BrokerError, UpstreamError
from mergebroker.merge.calibration import CallTokens
from mergebroker.merge.completion import member_completion
from mergebroker.merge.embedder import Embedder
from mergebroker.merge.merged_call import CallMember, CallRules, merged_call
from mergebroker.merge.quality_guard import QualityGuard
from mergebroker.merge.settle import (
    BAD_REPLY,
    MERGED_CALL_FAILED,
    BlockVerdict,
    SettleMember,
    Settlement,
    SettleOptions,
    apportion_reported,
    every_member,
    reply_text,
    settle,
    settle_call_error,
)
from mergebroker.providers.base import Pool
from mergebroker.token_usage import TokenUsage

log = structlog.get_logger(__name__)


class Dispatcher:
    """Turns released groups into upstream calls and outcomes for every member."""

    def __init__(self, pools: Pool, *, tiers: dict[str, TierMergePolicy], options: MergeOptions,
                 embedder: Embedder | None, guard: QualityGuard, merging_allowed: Callable[[str], bool],
                 metrics: Metrics | None = None, clock: Clock = monotonic,
                 on_merged_answer: Callable[[ChatJob, str, int], None] | None = None,
                 economy: MergeEconomy | None = None,
                 on_call_tokens: Callable[[str, str, CallTokens], None] | None = None) -> None:
        self._pools = pools
        self._tiers = tiers
        self._options = options
        self._guard = guard
        self._count = DispatchCounters(metrics)
        self._clock = clock
        self._planner = BatchPlanner(tiers, options, embedder=embedder, guard=guard, merging_allowed=merging_allowed,
                                     count=self._count, clock=clock, economy=economy,
                                     rpm_pressure=pools.rpm_pressure)
        self._economy = economy
        self._on_merged_answer = on_merged_answer  # (job, answer, batch size): the shadow comparison's sampler
        # (provider, model, tokens) of each merged call the provider reported usage for: the cost book
        # learns from it how the provider counts tokens (`merge.calibration`).
        self._on_call_tokens = on_call_tokens
        self._settling = SettleOptions(options.leak_min_words, count_text_tokens)

    def prefetch(self, tier: str, jobs: list[ChatJob]) -> None:
        """Start embedding prompts that have a merge partner while their window is still open
        (`BatchPlanner.prefetch`)."""
        self._planner.prefetch(tier, jobs)

    async def run_group(self, group: ReleasedGroup[ChatJob]) -> None:
        """Answer every member of the group (result or error); never raises but for cancellation."""
        jobs = [j for j in group.items if not j.future.done()]
        if jobs:
            await answer_all(jobs, self._run_group(group.tier, jobs))

    async def _run_group(self, tier: str, jobs: list[ChatJob]) -> None:
        batches = await self._planner.plan(tier, jobs)
        if len(batches) == 1:  # the common case needs no task of its own
            await self._run_batch(tier, batches[0])
        else:
            await asyncio.gather(*(answer_all(b, self._run_batch(tier, b)) for b in batches))

    async def _run_batch(self, tier: str, jobs: list[ChatJob]) -> None:
        # Callers gone before dispatch are dropped, and so are jobs their `before_send` hook keeps back.
        live = await clear_to_send([j for j in jobs if not j.future.done()])
        if not live:
            return
        self._count.batch(tier, len(live))
        if len(live) == 1:
            await self.run_single(live[0])
        else:
            await self._run_merged(tier, live)

    def run_alone(self, job: ChatJob) -> Coroutine[Any, Any, None]:
        """Send a job that never waited in a window on its own (a batch of one, counted as such), to await.

        It hands back `run_single`'s coroutine rather than awaiting it: every lone request comes this way."""
        self._count.batch(job.tier, 1)
        return self.run_single(job)

    async def run_single(self, job: ChatJob, *, fallback: str | None = None) -> None:
        """Send one request on its own and resolve its future."""
        started = self._clock()
        deadline = job.mark_sent()  # from here on followers no longer extend it
        if job.stream:
            await self._run_single_stream(job, deadline)
            return
        try:
            with tracing.parent(job.trace_context):  # queued: its call belongs to its request's trace
                body, provider = await self._pools.chat(job.model, job.body, deadline=deadline,
                                                        priority=job.priority, tokens=self._upstream_tokens(job),
                                                        tenant=job.caller.tenant)
            job.resolve(ChatOutcome(body, provider, self._clock() - started, fallback=fallback))
        except BrokerError as exc:
            job.fail(exc)
        except Exception as exc:  # noqa: BLE001 - a bug must still answer the caller
            log.exception("dispatch_failed", request_id=job.request_id)
            job.fail(UpstreamError(f"Internal error while dispatching: {type(exc).__name__}"))

    def _upstream_tokens(self, job: ChatJob) -> int:
        """What `job` takes from its upstream's token rate: its reserved tokens; 0 for a job whose prompt is not
        counted yet where no upstream of its model declares a token rate (nothing would read them)."""
        if job.prompt_tokens is None and not self._pools.limits_tokens(job.model):
            return 0
        return job.reserved_tokens

    async def _run_single_stream(self, job: ChatJob, deadline: float) -> None:
        """A streaming request that found no partner: its own upstream stream, relayed as it comes."""
        started = self._clock()
        try:
            with tracing.parent(job.trace_context):
                chunks, provider = await self._pools.stream_chat(job.model, with_usage_requested(job.body),
                                                                 deadline=deadline, priority=job.priority,
                                                                 tokens=self._upstream_tokens(job))
        except BrokerError as exc:
            job.fail(exc)
            return
        metered = MeteredStream(chunks, relay_usage=caller_wants_usage(job.body), prompt_tokens=job.counted_prompt())
        job.resolve(ChatOutcome({}, provider, self._clock() - started, stream=metered, settled_usage=metered.usage))
        if job.future.cancelled():  # the caller left meanwhile: free the upstream slot now
            await metered.aclose()

    async def _run_merged(self, tier: str, jobs: list[ChatJob]) -> None:
        first = jobs[0]
        rules = CallRules(count_text_tokens, self._options.header, self._tiers[tier].tagged_system)
        merged = merged_call([_call_member(j) for j in jobs], rules, output_limit=(
            self._economy.max_output_tokens(first.model) if self._economy is not None else None))
        by_id = dict(zip(merged.ids, jobs))
        batch_id = "b_" + uuid.uuid4().hex[:12]
        body = merged.body
        deadline = min([j.mark_sent() for j in jobs])
        members = list(merged.members)
        prompt_estimate = estimate_prompt_tokens(body["messages"])
        if first.stream or self._pools.streams_merged(first.model):
            # Bounded like a plain merged call, so a hung stream leaves time to re-send its open members alone.
            call = StreamCall(first.model, body, merged_call_deadline(self._clock(), deadline), first.priority,
                              prompt_estimate + body["max_tokens"], stream=first.stream)
            await self._run_streamed(tier, call, by_id, members, prompt_estimate, batch_id)
            return
        started = self._clock()
        bind_log_context(batch_id=batch_id)
        try:
            tenants = {j.caller.tenant for j in jobs}  # blame goes to one tenant only (breaker.blame)
            with tracing.merged_call(batch_id, (j.trace_context for j in jobs)):  # linked to every member
                reply, provider = await self._pools.chat(first.model, body,
                                                         deadline=merged_call_deadline(started, deadline),
                                                         priority=first.priority,
                                                         tokens=prompt_estimate + body["max_tokens"],
                                                         tenant=tenants.pop() if len(tenants) == 1 else None)
        except BrokerError as exc:
            settlement = settle_call_error(exc, members)
            if settlement.fallbacks:
                log.warning("merged_call_failed", batch_id=batch_id, size=len(jobs), error=type(exc).__name__)
            reply, provider = {}, ""
        else:
            read = reply_text(reply)
            self._observe_call(provider, first.model, prompt_estimate, TokenUsage.from_body(reply),
                               read[0] if read is not None else None)
            try:
                settlement = settle(reply, members, self._settling)
            except Exception:  # noqa: BLE001 - a reply we cannot read must not cost the members their answers
                log.exception("merged_reply_unreadable", batch_id=batch_id)
                settlement = every_member(members, BAD_REPLY)
        finally:
            unbind_log_context("batch_id")
        # Every member's outcome but its own body: each answer is its own completion, cut out of the reply.
        shared = ChatOutcome({}, provider, self._clock() - started, batch_size=len(by_id), batch_id=batch_id)
        retry_alone = self._execute(tier, reply, shared, by_id, settlement)
        await asyncio.gather(*(self.run_single(job, fallback=reason) for job, reason in retry_alone))

    async def _run_streamed(self, tier: str, call: StreamCall, by_id: dict[str, ChatJob],
                            members: list[SettleMember], prompt_estimate: int, batch_id: str) -> None:
        """Early release: the merged call streams, and each member is answered the moment its block closes
        and passes its checks (usage counted); the ledger settles with the reported usage at the end."""
        started, counted = self._clock(), CountedUsage(prompt_estimate, members)
        answers: dict[str, str] = {}
        settled: dict[str, asyncio.Future[TokenUsage]] = {}
        retry_alone: list[asyncio.Future[None]] = []
        streams = self._streamed_members(by_id, members, batch_id) if call.stream else None

        def on_verdict(member_id: str, verdict: BlockVerdict, reply: StreamedReply) -> None:
            job = by_id[member_id]
            if streams is not None:
                self._close_streamed(streams, member_id, verdict, counted, answers)
                return
            if verdict.answer is None:
                self._count.fallback(verdict.reason or BAD_REPLY)
                log.info("split_fallback", batch_id=batch_id, reason=verdict.reason, request_id=job.request_id)
                retry_alone.append(asyncio.ensure_future(self.run_single(job, fallback=verdict.reason)))
                return
            text = answers[member_id] = verdict.answer
            settled[member_id] = asyncio.get_running_loop().create_future()
            body = member_completion(reply.meta, text, counted.usage(member_id, text), model=job.model,
                                     finish_reason=verdict.finish_reason)
            job.resolve(ChatOutcome(body, reply.provider, self._clock() - started, batch_size=len(by_id),
                                    batch_id=batch_id, settled_usage=settled[member_id]))
            if self._on_merged_answer is not None:
                self._on_merged_answer(job, text, len(by_id))
            self._count.early_released(tier)

        bind_log_context(batch_id=batch_id)
        try:
            with tracing.merged_call(batch_id, (j.trace_context for j in by_id.values())):
                reply = await stream_blocks(self._pools, call, members, self._settling, on_verdict,
                                            clock=self._clock, on_delta=streams.feed if streams else None)
        except BrokerError as exc:  # before the first chunk: as a failed merged call
            settlement = settle_call_error(exc, members)
            if streams is not None:
                streams.fail_all(settlement.errors)
                return
            shared = ChatOutcome({}, "", self._clock() - started, batch_size=len(by_id), batch_id=batch_id)
            retry_alone += [asyncio.ensure_future(self.run_single(job, fallback=reason))
                            for job, reason in self._execute(tier, {}, shared, by_id, settlement)]
        else:
            self._streamed_to_the_end(tier, by_id, members, answers, reply, counted, settled, streams)
        finally:
            unbind_log_context("batch_id")
            settle_usage(settled, {i: counted.usage(i, text) for i, text in answers.items()})  # never left open
            if streams is not None:
                streams.settle_rest(counted.usage)
        if streams is not None:
            self._count.first_tokens(streams.first_tokens())
            retry_alone += streams.resent
        await asyncio.gather(*retry_alone)

    def _observe_call(self, provider: str, model: str, counted_prompt: int, reported: TokenUsage | None,
                      text: str | None) -> None:
        """Hand a merged call's counts both ways to the cost book's calibration (where it reported usage)."""
        if self._on_call_tokens is None or reported is None or reported.counted or text is None:
            return
        self._on_call_tokens(provider, model, CallTokens(counted_prompt, reported.prompt_tokens,
                                                         count_text_tokens(text), reported.completion_tokens))

    def _close_streamed(self, streams: StreamedMembers, member_id: str, verdict: BlockVerdict,
                        counted: CountedUsage, answers: dict[str, str]) -> None:
        """Merged streams: a member's verdict ends its stream (or sends it alone, counted as a fallback)."""
        usage = counted.usage(member_id, verdict.answer) if verdict.answer is not None else None
        if verdict.answer is not None:
            answers[member_id] = verdict.answer
        if not streams.close(member_id, verdict, usage):
            self._count.fallback(verdict.reason or BAD_REPLY)

    def _streamed_to_the_end(self, tier: str, by_id: dict[str, ChatJob], members: list[SettleMember],
                             answers: dict[str, str], reply: StreamedReply, counted: CountedUsage,
                             settled: dict[str, asyncio.Future[TokenUsage]],
                             streams: StreamedMembers | None) -> None:
        """A streamed merged call ended: the quality guard hears which members failed, released answers'
        usage settles with the provider's report (counted when it sent none), and the savings are counted."""
        failed = {i: "streamed" for i in by_id if i not in answers}
        self._record_guard(by_id, Settlement(fallbacks=failed, needed_fallback=bool(failed)))
        usage = apportion_reported(reply.usage, members, answers) if reply.usage else {
            i: counted.usage(i, text) for i, text in answers.items()}
        settle_usage(settled, usage)
        if streams is not None:
            streams.settle_answered(usage)
        if reply.usage:
            self._observe_call(reply.provider, next(iter(by_id.values())).model, counted.prompt_tokens,
                               reply.usage, "".join(reply.text))
        self._count.merged(tier, answered=len(answers), batch_size=len(by_id), tokens_saved=(
            sum(m.alone_prompt_tokens for m in members) - reply.usage.prompt_tokens if reply.usage else 0))

    def _streamed_members(self, by_id: dict[str, ChatJob], members: list[SettleMember],
                          batch_id: str) -> StreamedMembers:
        """Merged streams: every member answered at once with its own stream, fed as the reply streams."""
        streams = StreamedMembers(by_id, {m.id: m.request_text for m in members},
                                  hold_words=self._options.leak_min_words, resend_alone=self._stream_alone,
                                  include_usage={i: caller_wants_usage(j.body) for i, j in by_id.items()},
                                  clock=self._clock)
        for member_id, stream in streams.outcome_streams().items():
            by_id[member_id].resolve(ChatOutcome({}, None, 0.0, batch_size=len(by_id), batch_id=batch_id,
                                                 stream=stream, settled_usage=streams.usage[member_id]))
        return streams

    async def _stream_alone(self, job: ChatJob, stream: MemberStream, usage: asyncio.Future[Any]) -> None:
        """Re-send a streamed member alone: its stream switches over to the new one, or, when some of its
        text was sent already, continues from there (`MemberStream.resume_with`); `usage` is its own call's."""
        try:
            with tracing.parent(job.trace_context):
                chunks, _ = await self._pools.stream_chat(job.model, with_usage_requested(job.body),
                                                          deadline=job.deadline, priority=job.priority,
                                                          tokens=self._upstream_tokens(job))
        except BrokerError as exc:
            settle_future(usage, counted_usage(job.counted_prompt(), stream.released))
            stream.fail(exc)
            return
        resuming = stream.sent_text
        metered = MeteredStream(chunks, relay_usage=resuming or caller_wants_usage(job.body),
                                prompt_tokens=job.counted_prompt())
        if stream.ended:  # its caller left while the call opened: nobody will read it
            await metered.aclose()
            settle_future(usage, await metered.usage)
            return
        metered.usage.add_done_callback(lambda done: settle_future(usage, done.result()))
        if resuming:
            stream.resume_with(metered)
        else:
            stream.switch_to(metered)

    def _execute(self, tier: str, reply: dict[str, Any], shared: ChatOutcome, by_id: dict[str, ChatJob],
                 settlement: Settlement) -> list[tuple[ChatJob, str]]:
        """Carry out a settlement: answer, fail, count; return the members (with the reason) to re-send alone."""
        if settlement.needed_fallback is not None:
            self._record_guard(by_id, settlement)
        for member_id, answer in settlement.answers.items():
            body = member_completion(reply, answer.text, answer.usage, model=by_id[member_id].model,
                                     finish_reason=answer.finish_reason)
            by_id[member_id].resolve(replace(shared, body=body))
            if self._on_merged_answer is not None:
                self._on_merged_answer(by_id[member_id], answer.text, len(by_id))
        for member_id, exc in settlement.errors.items():
            by_id[member_id].fail(exc)
        self._count.merged(tier, answered=len(settlement.answers), batch_size=len(by_id),
                           tokens_saved=settlement.tokens_saved)
        for member_id, reason in settlement.fallbacks.items():
            self._count.fallback(reason)
            if reason != MERGED_CALL_FAILED:
                log.info("split_fallback", batch_id=shared.batch_id, reason=reason,
                         request_id=by_id[member_id].request_id)
        return [(by_id[i], reason) for i, reason in settlement.fallbacks.items()]

    def _record_guard(self, by_id: dict[str, ChatJob], settlement: Settlement) -> None:
        """One merged call's outcome, per tenant with members in it: did any of its members need a fallback."""
        model = next(iter(by_id.values())).model
        failed = {by_id[i].caller.tenant for i in settlement.fallbacks}
        for tenant in {j.caller.tenant for j in by_id.values()}:
            self._guard.record(tenant, model, bool(settlement.needed_fallback) and tenant in failed)


def _call_member(job: ChatJob) -> CallMember:
    return CallMember(job.body, job.shape, job.max_tokens, job.counted_prompt())  # type: ignore[arg-type]


MERGED_CALL_SHARE = 0.5
"""The share of its members' remaining time a merged call may take: a hung one leaves the rest for each
member to be re-sent alone (its read timeout, which grows with the sum of the members' budgets, never does)."""


def merged_call_deadline(now: float, members_deadline: float) -> float:
    """When a merged call sent at `now` must have answered, for its members to still be re-sent alone in time."""
    return now + max(0.0, members_deadline - now) * MERGED_CALL_SHARE
