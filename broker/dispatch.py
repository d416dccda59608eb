"""Dispatch a released group: plan batches, send single or merged calls, split, fall back.

Deciding is pure (`merge.grouping`, `merge.split`, `merge.leak`); this module only acts: it embeds the
prompts of a group that could merge, sends each batch through the provider pools, and hands every
member exactly one outcome. A member whose block is missing, broken, or leaks another member's text is
re-sent alone within its own deadline; a merged call that fails re-sends all its members alone.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import structlog

from broker.clock import Clock, monotonic
from broker.errors import BrokerError, DeadlineExceeded, UpstreamError, UpstreamUnavailable
from broker.jobs import ChatJob, ChatOutcome
from broker.metrics import Metrics
from broker.queue import ReleasedGroup
from broker.tokens import count_text_tokens, estimate_prompt_tokens
from merge.embedder import Embedder
from merge.grouping import group_by_similarity, needs_embedding
from merge.leak import find_leaks
from merge.prompt import MergeMember, build_combined_messages, merged_max_tokens, new_batch_ids
from merge.quality_guard import QualityGuard
from merge.split import BlockFailure, split_reply
from merge.usage import apportion_usage
from providers.pool import ProviderPools

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class TierMergePolicy:
    """How one tier merges."""

    merge: bool
    threshold: float
    max_batch: int
    tagged_system: bool = False


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

    async def run_group(self, group: ReleasedGroup[ChatJob]) -> None:
        """Answer every member of the group (result or error); never raises."""
        jobs = [j for j in group.items if not j.future.done()]
        if not jobs:
            return
        batches = await self._plan(group.tier, jobs)
        if len(batches) == 1:  # the common case needs no task of its own
            await self._run_batch(group.tier, batches[0])
        else:
            await asyncio.gather(*(self._run_batch(group.tier, b) for b in batches))

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
            started = time.perf_counter()
            vectors = await self._embedder.embed([j.shape.user_text for j in jobs])  # type: ignore[union-attr]
            if self._metrics:
                self._metrics.embedding_seconds.observe(time.perf_counter() - started)
        budget = self._options.context_tokens.get(model, self._options.default_context_tokens)
        costs = [j.prompt_tokens + j.max_tokens for j in jobs]
        plan = group_by_similarity(vectors, threshold=policy.threshold, max_batch=policy.max_batch,
                                   costs=costs, budget=budget)
        return [[jobs[i] for i in batch] for batch in plan]

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
        try:
            body, provider = await self._pools.chat(job.model, job.body, deadline=job.deadline,
                                                    priority=job.priority, tokens=job.prompt_tokens + job.max_tokens)
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
        deadline = min(j.deadline for j in jobs)
        started = self._clock()
        structlog.contextvars.bind_contextvars(batch_id=batch_id)
        try:
            reply, provider = await self._pools.chat(first.model, body, deadline=deadline, priority=first.priority,
                                                     tokens=estimate_prompt_tokens(body["messages"]) + body["max_tokens"])
        except UpstreamUnavailable as exc:
            for job in jobs:
                job.fail(exc)
            return
        except (UpstreamError, DeadlineExceeded) as exc:
            log.warning("merged_call_failed", batch_id=batch_id, size=len(jobs), error=type(exc).__name__)
            self._count_fallback("merged_call_failed", len(jobs))
            self._guard.record(first.model, True)
            await asyncio.gather(*(self.run_single(j, fallback="merged_call_failed") for j in jobs))
            return
        finally:
            structlog.contextvars.unbind_contextvars("batch_id")
        upstream_s = self._clock() - started
        retry_alone = self._finish_merged(tier, by_id, reply, provider, upstream_s, batch_id)
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
        choice = (reply.get("choices") or [{}])[0]
        content = (choice.get("message") or {}).get("content") or ""
        answers = split_reply(content, list(by_id), finish_reason=choice.get("finish_reason"))
        good = {i: a for i, a in answers.items() if isinstance(a, str)}
        questions = {i: j.shape.user_text for i, j in by_id.items()}  # type: ignore[union-attr]
        for leaked in find_leaks(good, questions, min_words=self._options.leak_min_words):
            answers[leaked] = "leak"  # type: ignore[assignment]
            good.pop(leaked)
        failed = {i: a for i, a in answers.items() if not isinstance(a, str) or i not in good}
        self._guard.record(next(iter(by_id.values())).model, bool(failed))
        usage = self._apportion(reply, by_id, good)
        stop = next(iter(by_id.values())).body.get("stop")
        for member_id, text in good.items():
            job = by_id[member_id]
            body = member_completion(reply, apply_stop(text, stop), usage[member_id])
            job.resolve(ChatOutcome(body, provider, upstream_s, batch_size=len(by_id), batch_id=batch_id))
        if self._metrics and good:
            self._metrics.merged_requests.labels(tier).inc(len(good))
            self._metrics.upstream_calls_saved.inc(len(by_id) - 1)
            alone = sum(by_id[i].prompt_tokens for i in by_id)
            self._metrics.tokens_saved.inc(max(0, alone - int((reply.get("usage") or {}).get("prompt_tokens", 0))))
        retry_alone = []
        for member_id, reason in failed.items():
            label = reason if isinstance(reason, str) else reason.value
            self._count_fallback(label, 1)
            log.info("split_fallback", batch_id=batch_id, reason=label, request_id=by_id[member_id].request_id)
            retry_alone.append((by_id[member_id], label))
        return retry_alone

    def _apportion(self, reply: dict[str, Any], by_id: dict[str, ChatJob], good: dict[str, str]) -> dict[str, dict]:
        usage = reply.get("usage") or {}
        member_tokens = {i: count_text_tokens(j.shape.user_text) for i, j in by_id.items()}  # type: ignore
        own_total = sum(member_tokens.values())
        return apportion_usage(
            {"prompt_tokens": int(usage.get("prompt_tokens", 0)),
             "completion_tokens": int(usage.get("completion_tokens", 0))},
            shared_prompt_tokens=max(0, int(usage.get("prompt_tokens", 0)) - own_total),
            member_prompt_tokens=member_tokens,
            member_completion_weights={i: max(1, len(good.get(i, ""))) for i in by_id},
        )

    def _count_fallback(self, reason: str, n: int) -> None:
        if self._metrics:
            self._metrics.split_fallback.labels(reason).inc(n)


def apply_stop(text: str, stop: str | list[str] | None) -> str:
    """Cut a member's answer at its first stop sequence, as the upstream would have."""
    sequences = [stop] if isinstance(stop, str) else list(stop or [])
    cut = min((i for i in (text.find(s) for s in sequences if s) if i >= 0), default=len(text))
    return text[:cut]


def member_completion(reply: dict[str, Any], text: str, usage: dict[str, int]) -> dict[str, Any]:
    """A complete `chat.completion` of a member's own, cut out of a merged reply."""
    return {
        "id": "chatcmpl-" + uuid.uuid4().hex[:24],
        "object": "chat.completion",
        "created": reply.get("created", int(time.time())),
        "model": reply.get("model"),
        "system_fingerprint": reply.get("system_fingerprint"),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                     "finish_reason": "stop"}],
        "usage": usage,
    }
