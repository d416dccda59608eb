"""Planning a released group: which of its requests share an upstream call (the batches), decided before
anything is sent.

A group merges only where its tier merges, the model's upstreams are healthy enough (`merging_allowed`)
and the quality guard allows the tenant; then its prompts are embedded (within the tier's similarity
budget, prefetched while the window was open) and `merge.grouping.group_by_similarity` plans batches of
similar prompts that fit the model's context (the shared system prompt and the header counted once, the
model's real context window where the price table knows it). Each planned batch is then cut into the merges
that pay (`engine.merge_economy`: on cost, and so that no merged call asks for more output than the model
gives). Whenever similarity cannot be judged in time, every request goes alone: always correct, never
wrongly merged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from mergebroker.broker.engine.accounting.merge_economy import Candidate, MergeEconomy
from mergebroker.broker.engine.chat.counters import DispatchCounters
from mergebroker.broker.engine.chat.jobs import ChatJob
from mergebroker.broker.engine.ground.tokens import count_text_tokens
from mergebroker.clock import Clock
from mergebroker.merge.budget import context_shares
from mergebroker.merge.embedder import Backlogged, Embedder
from mergebroker.merge.grouping import group_by_similarity, needs_embedding
from mergebroker.merge.prompt import BLOCK_OVERHEAD_TOKENS, DEFAULT_HEADER
from mergebroker.merge.quality_guard import QualityGuard

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


class BatchPlanner:
    """Plans the batches of released groups (see the module docstring)."""

    def __init__(self, tiers: dict[str, TierMergePolicy], options: MergeOptions, *, embedder: Embedder | None,
                 guard: QualityGuard, merging_allowed: Callable[[str], bool], count: DispatchCounters,
                 clock: Clock, economy: MergeEconomy | None = None,
                 rpm_pressure: Callable[[str], float] = lambda _model: 0.0) -> None:
        self._tiers = tiers
        self._options = options
        self._embedder = embedder
        self._paced = embedder if isinstance(embedder, Backlogged) else None  # one that can tell its backlog
        self._guard = guard
        self._merging_allowed = merging_allowed
        self._count = count
        self._clock = clock
        self._economy = economy
        self._rpm_pressure = rpm_pressure
        self._header_tokens = count_text_tokens(options.header or DEFAULT_HEADER)
        self._prefetching: set[asyncio.Future[Any]] = set()

    def prefetch(self, tier: str, jobs: list[ChatJob]) -> None:
        """Start embedding prompts that have a merge partner while their window is still open.

        The queue calls this as partners arrive; the vectors land in the embedder's cache (or are awaited
        there if still running), so the group rarely waits for the model when its window closes. Nothing is
        queued while the model is already further behind than the tier's similarity budget.
        """
        policy = self._tiers.get(tier)
        if (policy is None or not policy.merge or self._embedder is None or not self._embedder.ready
                or not needs_embedding(2, policy.threshold)):
            return
        texts = [j.shape.user_text for j in jobs if j.shape is not None]
        if texts and not self._behind(policy.similarity_budget_s):
            task = asyncio.ensure_future(self._embedder.embed(texts))
            self._prefetching.add(task)
            task.add_done_callback(self._prefetched)

    def _prefetched(self, task: asyncio.Future[Any]) -> None:
        self._prefetching.discard(task)
        _retrieve(task)

    async def plan(self, tier: str, jobs: list[ChatJob]) -> list[list[ChatJob]]:
        """The batches to send for a released group of `tier`: lists of its jobs, one call each."""
        policy = self._tiers[tier]
        model, shape = jobs[0].model, jobs[0].shape
        if len(jobs) == 1 or not policy.merge or shape is None or not self._merging_allowed(model):
            return [[j] for j in jobs]
        paused = [[j] for j in jobs if not self._guard.allows(j.caller.tenant, model)]  # only their own tenant's
        if paused:
            jobs = [j for j in jobs if self._guard.allows(j.caller.tenant, model)]
            return paused + (await self.plan(tier, jobs) if jobs else [])
        vectors = None
        if needs_embedding(len(jobs), policy.threshold):
            if self._embedder is None or not self._embedder.ready:
                return [[j] for j in jobs]  # cannot judge similarity yet: send alone, never wrongly merged
            vectors = await self._vectors(tier, jobs, policy.similarity_budget_s)
            if vectors is None:
                return [[j] for j in jobs]
        system = None if policy.tagged_system else shape.system_prompt
        shared = count_text_tokens(system) if system else 0
        costs, budget = context_shares([j.reserved_tokens for j in jobs], window=self._context_window(model),
                                       shared=shared, header=self._header_tokens)
        plan = group_by_similarity(vectors, threshold=policy.threshold, max_batch=policy.max_batch,
                                   costs=costs, budget=budget)
        return self._on_cost(model, system, shared, [[jobs[i] for i in batch] for batch in plan])

    def _context_window(self, model: str) -> int:
        configured = self._options.context_tokens.get(model)
        if configured is not None or self._economy is None:
            return configured if configured is not None else self._options.default_context_tokens
        return self._economy.context_window(model, self._options.default_context_tokens)

    def _on_cost(self, model: str, system: str | None, shared: int, batches: list[list[ChatJob]]
                 ) -> list[list[ChatJob]]:
        """Each batch cut into the merges worth making (`MergeEconomy.split`); members left alone are counted."""
        if self._economy is None:
            return batches
        out: list[list[ChatJob]] = []
        for batch in batches:
            if len(batch) < 2:
                out.append(batch)
                continue
            candidates = [Candidate(j.counted_prompt(), max(0, j.counted_prompt() - shared), j.max_tokens) for j in batch]
            sizes = self._economy.split(model, system, candidates, rpm_pressure=self._rpm_pressure(model),
                                        tag_tokens=BLOCK_OVERHEAD_TOKENS)
            start = 0
            for size in sizes:
                out.append(batch[start:start + size])
                start += size
            alone = sum(1 for size in sizes if size == 1)
            if alone and len(sizes) > 1:
                self._count.similarity_skipped("not_cheaper", alone)
        return out

    def _behind(self, time_left_s: float) -> bool:
        """Whether the similarity model's queued work alone takes longer than `time_left_s` (`Backlogged`)."""
        return self._paced is not None and self._paced.backlog_s > time_left_s

    async def _vectors(self, tier: str, jobs: list[ChatJob], budget_s: float) -> Any:
        """The group's prompt vectors, or None when the model fails or they are not ready `budget_s` after the
        group's first request arrived.

        A worker never waits long on the model: a busy model would otherwise hold every group behind it.
        Past the budget the group goes out unmerged (always correct), and the encode still finishes in the
        background, so the vectors are cached for the paraphrases that come next. A group with prompts not
        yet queued goes out at once, without queueing them, when the model is further behind than the group
        can still wait: under sustained overload the backlog stays bounded by the budget, and no group waits
        for vectors that cannot come in time (`prefetch` holds back the same way).
        """
        started = self._clock()
        # The budget counts from the group's first arrival, not from its release: the prompts were embedded
        # while the window was open (`prefetch`), so the time the window took is time the model already had.
        first_arrival = min(j.enqueued_at for j in jobs)
        texts = [j.shape.user_text for j in jobs]  # type: ignore[union-attr]
        known = self._paced is None or self._paced.covers(texts)  # cached or being encoded: no new work
        if not known and self._behind(first_arrival + budget_s - started):
            # The model is further behind than this group can wait: queueing its prompts would only grow a
            # backlog nobody can use in time (a host starved for CPU, or more prompts than the model can take).
            self._count.similarity_skipped("similarity_slow", len(jobs))
            return None
        encode = asyncio.ensure_future(self._embedder.embed(texts))  # type: ignore[union-attr]
        try:
            async with self._clock.timeout_at(first_arrival + budget_s):
                vectors = await asyncio.shield(encode)
        except TimeoutError:
            if encode.done() and not encode.cancelled() and encode.exception() is None:
                return encode.result()  # ready (cached vectors) though the budget ran out during the window
            encode.add_done_callback(_retrieve)
            self._count.similarity_skipped("similarity_slow", len(jobs))
            return None
        except Exception as exc:  # noqa: BLE001 - without similarity, sending alone is always correct
            log.warning("embedding_failed", tier=tier, size=len(jobs), error=type(exc).__name__)
            self._count.similarity_skipped("similarity_failed", len(jobs))
            return None
        self._count.embedding_time(self._clock() - started)
        return vectors


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Mark a background encode's error as seen (it is logged where it matters: the next caller's encode)."""
    if not task.cancelled():
        task.exception()
