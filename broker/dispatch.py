"""Dispatch a released group: plan batches, send single or merged calls, split, fall back.

Deciding is pure (`merge.grouping`, `merge.split`, `merge.leak`); this module only acts: it embeds the
prompts of a group that could merge, sends each batch through the provider pools, and hands every
member exactly one outcome. A member whose block is missing, broken, or leaks another member's text is
re-sent alone within its own deadline; a merged call that fails, or whose reply cannot be read, re-sends
all its members alone. Whatever goes wrong, no member's future is left unset (`_answer_all`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import structlog

from mergebroker.clock import Clock, monotonic
from mergebroker.errors import BrokerError, NotFound, Overloaded, UpstreamError, UpstreamUnavailable
from mergebroker.broker.jobs import ChatJob, ChatOutcome
from mergebroker.broker.metrics import Metrics
from mergebroker.broker.queue import ReleasedGroup
from mergebroker.broker.tokens import count_text_tokens, estimate_prompt_tokens
from mergebroker.merge.embedder import Embedder
from mergebroker.merge.grouping import group_by_similarity, needs_embedding
from mergebroker.merge.leak import find_leaks
from mergebroker.merge.prompt import MergeMember, build_combined_messages, merged_max_tokens, new_batch_ids
from mergebroker.merge.quality_guard import QualityGuard
from mergebroker.merge.split import split_reply
from mergebroker.merge.usage import apportion_usage
from mergebroker.providers.pool import ProviderPools

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class TierMergePolicy:
    """How one tier merges."""

    merge: bool
    threshold: float
    max_batch: int
    tagged_system: bool = False
    similarity_budget_s: float = 0.05  # longest a group waits for its vectors before it is sent unmerged


@dataclass(frozen=True)
class MergeOptions:
    """Engine-wide merge options (from settings)."""

    header: str | None
    leak_min_words: int
    context_tokens: dict[str, int]
    default_context_tokens: int


class Dispatcher:
    """Turns released groups into upstream calls and outcomes for every member."""

    def __init__(self, pools: ProviderPools, *, tiers: dict[str, TierMergePolicy], options: MergeOptions,
                 embedder: Embedder | None, guard: QualityGuard, merging_allowed: Callable[[str], bool],
                 metrics: Metrics | None = None, clock: Clock = monotonic) -> None:
        self._pools = pools
        self._tiers = tiers
        self._options = options
        self._embedder = embedder
        self._guard = guard
        self._merging_allowed = merging_allowed
        self._metrics = metrics
        self._clock = clock
        self._batch_metrics: dict[str, tuple[Any, Any]] = {}  # labelled children by tier, looked up once
        self._prefetching: set[asyncio.Future[Any]] = set()

    def prefetch(self, tier: str, jobs: list[ChatJob]) -> None:
        """Start embedding prompts that have a merge partner while their window is still open.

        The queue calls this as partners arrive; the vectors land in the embedder's cache (or are awaited
        there if still running), so the group rarely waits for the model when its window closes.
        """
        policy = self._tiers.get(tier)
        if (policy is None or not policy.merge or self._embedder is None or not self._embedder.ready
                or not needs_embedding(2, policy.threshold)):
            return
        texts = [j.shape.user_text for j in jobs if j.shape is not None]
        if texts:
            task = asyncio.ensure_future(self._embedder.embed(texts))
            self._prefetching.add(task)
            task.add_done_callback(self._prefetched)

    def _prefetched(self, task: asyncio.Future[Any]) -> None:
        self._prefetching.discard(task)
        _retrieve(task)

    async def run_group(self, group: ReleasedGroup[ChatJob]) -> None:
        """Answer every member of the group (result or error); never raises but for cancellation."""
        jobs = [j for j in group.items if not j.future.done()]
        if jobs:
            await _answer_all(jobs, self._run_group(group.tier, jobs))

    async def _run_group(self, tier: str, jobs: list[ChatJob]) -> None:
        batches = await self._plan(tier, jobs)
        if len(batches) == 1:  # the common case needs no task of its own
            await self._run_batch(tier, batches[0])
        else:
            await asyncio.gather(*(_answer_all(b, self._run_batch(tier, b)) for b in batches))

    async def _plan(self, tier: str, jobs: list[ChatJob]) -> list[list[ChatJob]]:
        policy = self._tiers[tier]
        model = jobs[0].model
        if (len(jobs) == 1 or not policy.merge or jobs[0].shape is None
                or not self._merging_allowed(model) or not self._guard.allows(model)):
            return [[j] for j in jobs]
        vectors = None
        if needs_embedding(len(jobs), policy.threshold):
            if self._embedder is None or not self._embedder.ready:
                return [[j] for j in jobs]  # cannot judge similarity yet: send alone, never wrongly merged
            vectors = await self._vectors(tier, jobs, policy.similarity_budget_s)
            if vectors is None:
                return [[j] for j in jobs]
        budget = self._options.context_tokens.get(model, self._options.default_context_tokens)
        costs = [j.prompt_tokens + j.max_tokens for j in jobs]
        plan = group_by_similarity(vectors, threshold=policy.threshold, max_batch=policy.max_batch,
                                   costs=costs, budget=budget)
        return [[jobs[i] for i in batch] for batch in plan]

    async def _vectors(self, tier: str, jobs: list[ChatJob], budget_s: float) -> Any:
        """The group's prompt vectors, or None when the model fails or is slower than `budget_s`.

        A worker never waits long on the model: a busy model would otherwise hold every group behind it.
        Past the budget the group goes out unmerged (always correct), and the encode still finishes in the
        background, so the vectors are cached for the paraphrases that come next.
        """
        started = time.perf_counter()
        encode = asyncio.ensure_future(self._embedder.embed([j.shape.user_text for j in jobs]))  # type: ignore
        try:
            vectors = await asyncio.wait_for(asyncio.shield(encode), budget_s)
        except asyncio.TimeoutError:
            encode.add_done_callback(_retrieve)
            if self._metrics:
                self._metrics.merge_skipped.labels("similarity_slow").inc(len(jobs))
            return None
        except Exception as exc:  # noqa: BLE001 - without similarity, sending alone is always correct
            log.warning("embedding_failed", tier=tier, size=len(jobs), error=type(exc).__name__)
            if self._metrics:
                self._metrics.merge_skipped.labels("similarity_failed").inc(len(jobs))
            return None
        if self._metrics:
            self._metrics.embedding_seconds.observe(time.perf_counter() - started)
        return vectors

    async def _run_batch(self, tier: str, jobs: list[ChatJob]) -> None:
        live = [j for j in jobs if not j.future.done()]  # callers gone before dispatch are dropped
        if not live:
            return
        if self._metrics:
            batches, batch_size = self._tier_metrics(tier)
            batches.inc()
            batch_size.observe(len(live))
        if len(live) == 1:
            await self.run_single(live[0])
        else:
            await self._run_merged(tier, live)

    async def run_single(self, job: ChatJob, *, fallback: str | None = None) -> None:
        """Send one request on its own and resolve its future."""
        started = self._clock()
        job.dispatched = True  # from here on `job.deadline` is the one the call runs under
        try:
            body, provider = await self._pools.chat(job.model, job.body, deadline=job.deadline,
                                                    priority=job.priority, tokens=job.prompt_tokens + job.max_tokens,
                                                    tenant=job.caller.tenant)
            job.resolve(ChatOutcome(body, provider, self._clock() - started, fallback=fallback))
        except BrokerError as exc:
            job.fail(exc)
        except Exception as exc:  # noqa: BLE001 - a bug must still answer the caller
            log.exception("dispatch_failed", request_id=job.request_id)
            job.fail(UpstreamError(f"Internal error while dispatching: {type(exc).__name__}"))

    async def _run_merged(self, tier: str, jobs: list[ChatJob]) -> None:
        ids = new_batch_ids(len(jobs))
        by_id = dict(zip(ids, jobs))
        batch_id = "b_" + uuid.uuid4().hex[:12]
        policy = self._tiers[tier]
        first = jobs[0]
        members = [MergeMember(i, j.shape.user_text, j.max_tokens, j.shape.system_prompt)  # type: ignore[union-attr]
                   for i, j in by_id.items()]
        # A stop sequence met in one member's answer would cut every later block: apply it per member instead.
        body = {k: v for k, v in first.body.items()
                if k not in ("max_tokens", "max_completion_tokens", "user", "stop")}
        body["messages"] = build_combined_messages(members, system_prompt=first.shape.system_prompt,  # type: ignore
                                                   header=self._options.header, tagged_system=policy.tagged_system)
        body["max_tokens"] = merged_max_tokens(members, model_limit=None, per_member_overhead=12)
        for job in jobs:
            job.dispatched = True
        deadline = min(j.deadline for j in jobs)
        started = self._clock()
        structlog.contextvars.bind_contextvars(batch_id=batch_id)
        try:
            tenants = {j.caller.tenant for j in jobs}  # blame goes to one tenant only (breaker.blame)
            reply, provider = await self._pools.chat(first.model, body, deadline=deadline, priority=first.priority,
                                                     tokens=estimate_prompt_tokens(body["messages"]) + body["max_tokens"],
                                                     tenant=tenants.pop() if len(tenants) == 1 else None)
        except (UpstreamUnavailable, NotFound) as exc:  # alone, each would meet the same refusal
            for job in jobs:
                job.fail(exc)
            return
        except BrokerError as exc:
            # Anything else may be the merged call's own problem (its size, its deadline, the upstream
            # that took it): each member gets its own call, within its own deadline.
            log.warning("merged_call_failed", batch_id=batch_id, size=len(jobs), error=type(exc).__name__)
            self._count_fallback("merged_call_failed", len(jobs))
            self._guard.record(first.model, True)
            await asyncio.gather(*(self.run_single(j, fallback="merged_call_failed") for j in jobs))
            return
        finally:
            structlog.contextvars.unbind_contextvars("batch_id")
        upstream_s = self._clock() - started
        try:
            retry_alone = self._finish_merged(tier, by_id, reply, provider, upstream_s, batch_id)
        except Exception:  # noqa: BLE001 - a reply we cannot read must not cost the members their answers
            log.exception("merged_reply_unreadable", batch_id=batch_id)
            retry_alone = self._bad_reply(first.model, [j for j in jobs if not j.future.done()], batch_id)
        await asyncio.gather(*(self.run_single(job, fallback=reason) for job, reason in retry_alone))

    def _tier_metrics(self, tier: str) -> tuple[Any, Any]:
        # `labels()` costs more than the increment itself, so each tier's children are looked up once.
        children = self._batch_metrics.get(tier)
        if children is None:
            m = self._metrics
            children = self._batch_metrics[tier] = (m.batches.labels(tier), m.batch_size.labels(tier))  # type: ignore
        return children

    def _finish_merged(self, tier: str, by_id: dict[str, ChatJob], reply: dict[str, Any], provider: str,
                       upstream_s: float, batch_id: str) -> list[tuple[ChatJob, str]]:
        """Resolve the members whose block is good; return the others (with the reason) to re-send alone."""
        read = reply_text(reply)
        if read is None:
            return self._bad_reply(next(iter(by_id.values())).model, list(by_id.values()), batch_id)
        content, finish_reason = read
        answers = split_reply(content, list(by_id), finish_reason=finish_reason)
        good = {i: a for i, a in answers.items() if isinstance(a, str)}
        # With tagged system prompts each member's own system prompt is in the call too: quoting it is a leak.
        tagged = self._tiers[tier].tagged_system
        questions = {i: _request_text(j, tagged) for i, j in by_id.items()}
        for leaked in find_leaks(good, questions, min_words=self._options.leak_min_words):
            answers[leaked] = "leak"  # type: ignore[assignment]
            good.pop(leaked)
        failed = {i: a for i, a in answers.items() if not isinstance(a, str) or i not in good}
        self._guard.record(next(iter(by_id.values())).model, bool(failed))
        usage = self._apportion(reply, by_id, good)
        stop = next(iter(by_id.values())).body.get("stop")
        for member_id, text in good.items():
            job = by_id[member_id]
            body = member_completion(reply, apply_stop(text, stop), usage[member_id], model=job.model)
            job.resolve(ChatOutcome(body, provider, upstream_s, batch_size=len(by_id), batch_id=batch_id))
        if self._metrics and good:
            self._metrics.merged_requests.labels(tier).inc(len(good))
            self._metrics.upstream_calls_saved.inc(len(by_id) - 1)
            alone = sum(by_id[i].prompt_tokens for i in by_id)
            sent = _count((reply.get("usage") if isinstance(reply.get("usage"), dict) else {}).get("prompt_tokens"))
            self._metrics.tokens_saved.inc(max(0, alone - sent))
        retry_alone = []
        for member_id, reason in failed.items():
            label = reason if isinstance(reason, str) else reason.value
            self._count_fallback(label, 1)
            log.info("split_fallback", batch_id=batch_id, reason=label, request_id=by_id[member_id].request_id)
            retry_alone.append((by_id[member_id], label))
        return retry_alone

    def _bad_reply(self, model: str, jobs: list[ChatJob], batch_id: str) -> list[tuple[ChatJob, str]]:
        """Every member of a merged call whose reply is unusable, to re-send alone."""
        log.warning("split_fallback", batch_id=batch_id, reason="bad_reply", size=len(jobs))
        self._count_fallback("bad_reply", len(jobs))
        self._guard.record(model, True)
        return [(job, "bad_reply") for job in jobs]

    def _apportion(self, reply: dict[str, Any], by_id: dict[str, ChatJob], good: dict[str, str]) -> dict[str, dict]:
        usage = reply.get("usage")
        usage = usage if isinstance(usage, dict) else {}
        prompt, completion = _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens"))
        member_tokens = {i: count_text_tokens(j.shape.user_text) for i, j in by_id.items()}  # type: ignore
        own_total = sum(member_tokens.values())
        return apportion_usage(
            {"prompt_tokens": prompt, "completion_tokens": completion},
            shared_prompt_tokens=max(0, prompt - own_total),
            member_prompt_tokens=member_tokens,
            member_completion_weights={i: max(1, len(good.get(i, ""))) for i in by_id},
        )

    def _count_fallback(self, reason: str, n: int) -> None:
        if self._metrics:
            self._metrics.split_fallback.labels(reason).inc(n)


async def _answer_all(jobs: list[ChatJob], work: Awaitable[None]) -> None:
    """Await `work`, then make sure no job of `jobs` is left without an answer, whatever happened."""
    try:
        await work
    except asyncio.CancelledError:  # the worker is stopping: the broker is shutting down
        _fail_unanswered(jobs, Overloaded("The broker is shutting down.", retry_after=1))
        raise
    except Exception as exc:  # noqa: BLE001 - a bug must still answer every caller, at once
        log.exception("dispatch_failed", size=len(jobs), error=type(exc).__name__)
        _fail_unanswered(jobs, exc if isinstance(exc, BrokerError) else BrokerError(
            f"The broker failed while dispatching the request ({type(exc).__name__}).", status=500,
            code="dispatch_failed"))
    else:
        if _fail_unanswered(jobs, BrokerError("The broker lost track of the request.", status=500,
                                              code="dispatch_failed")):
            log.error("dispatch_left_jobs_unanswered", size=len(jobs))


def _fail_unanswered(jobs: list[ChatJob], exc: BrokerError) -> int:
    """Fail the jobs still waiting; how many there were."""
    waiting = [j for j in jobs if not j.future.done()]
    for job in waiting:
        job.fail(exc)
    return len(waiting)


def reply_text(reply: Any) -> tuple[str, str | None] | None:
    """The first choice's text and finish reason of a merged reply, or None when the reply is unusable."""
    choices = reply.get("choices") if isinstance(reply, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices else None
    message = choice.get("message") if isinstance(choice, dict) else None
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, str):
        return None
    finish_reason = choice.get("finish_reason")  # type: ignore[union-attr]
    return content, finish_reason if isinstance(finish_reason, str) else None


def _request_text(job: ChatJob, tagged_system: bool) -> str:
    shape = job.shape
    if tagged_system and shape.system_prompt:  # type: ignore[union-attr]
        return shape.system_prompt + "\n" + shape.user_text  # type: ignore[union-attr]
    return shape.user_text  # type: ignore[union-attr]


def _count(value: Any) -> int:
    """A token count from an upstream's usage object; anything but a non-negative number counts as 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        return 0
    return int(value)


def apply_stop(text: str, stop: str | list[str] | None) -> str:
    """Cut a member's answer at its first stop sequence, as the upstream would have."""
    sequences = [stop] if isinstance(stop, str) else list(stop or [])
    cut = min((i for i in (text.find(s) for s in sequences if s) if i >= 0), default=len(text))
    return text[:cut]


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Mark a background encode's error as seen (it is logged where it matters: the next caller's encode)."""
    if not task.cancelled():
        task.exception()


def member_completion(reply: dict[str, Any], text: str, usage: dict[str, int], *, model: str = "") -> dict[str, Any]:
    """A complete `chat.completion` of a member's own, cut out of a merged reply: every field an unmerged
    answer has (the spec's required `refusal` too); `model` stands in when the reply names none."""
    body = {
        "id": "chatcmpl-" + uuid.uuid4().hex[:24],
        "object": "chat.completion",
        "created": reply.get("created") if isinstance(reply.get("created"), int) else int(time.time()),
        "model": reply.get("model") if isinstance(reply.get("model"), str) else model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                     "logprobs": None, "finish_reason": "stop"}],
        "usage": usage,
    }
    if isinstance(reply.get("system_fingerprint"), str):
        body["system_fingerprint"] = reply["system_fingerprint"]
    return body
