"""Run one bulk job: compact its unanswered lines, send the calls, settle the replies, re-run failures alone.

Deciding is pure (`broker.bulk.items`, `merge.compaction.plan_compaction`, `broker.bulk.settling`); this
module acts. The plan follows the live path's rules: the model's real context window, each member's own
budget in the merged call's `max_tokens` (within the model's output limit), and `merge.policy` on cost
(`engine.merge_economy`, over the broker's price table). Round 0 sends the compacted plan; members whose block failed (or whose merged call failed) go
to round 1, planned with `max_batch=1`, where each line is a call of its own and any failure is that line's
error. Each model's calls go through a provider's own Batch API when one serving it has `batch_api: true`
(`broker.bulk.upstream_rounds`), otherwise through the provider pools at the lowest priority, within the
providers' RPM/TPM, `batches.concurrency` calls at a time across all jobs, shared round-robin across tenants
(`broker.bulk.fair`). Describing and planning a large file run in a worker thread, off the event loop. A call
that fails in a way nobody foresaw fails its own lines, never the job. Every line's result is handed to the
`JobSink` as soon as it is known; the sink persists it, so a restarted broker resumes with the lines still
unanswered (and polls an upstream batch already submitted). Settling a merged reply (splitting, leak checks)
also runs in a worker thread: it costs milliseconds per call, which many calls in a row would take from the
loop.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from mergebroker.broker.bulk.fair import FairSlots
from mergebroker.broker.bulk.items import ItemContext, bulk_items
from mergebroker.broker.bulk.lines import BatchLine
from mergebroker.broker.bulk.settling import CallShare, Outcome, Result, call_share, failed, judge
from mergebroker.broker.bulk.store import BatchStore
from mergebroker.broker.bulk.upstream_rounds import RoundHooks, UpstreamRounds
from mergebroker.broker.engine.accounting.costs import CostBook
from mergebroker.broker.engine.accounting.merge_economy import Candidate, MergeEconomy, economy_for
from mergebroker.broker.engine.chat.jobs import aged_rank
from mergebroker.broker.engine.ground.metrics import Metrics
from mergebroker.broker.engine.ground.settings import Settings
from mergebroker.broker.engine.ground.tokens import count_text_tokens
from mergebroker.broker.engine.limits.admission import Caller
from mergebroker.broker.engine.limits.ratelimit import LimitSpec
from mergebroker.clock import Clock, Sleep, sleep_or_event
from mergebroker.errors import BrokerError, RateLimited, UpstreamUnavailable
from mergebroker.merge.compaction import BulkItem, CompactionRules, PlannedCall, plan_compaction
from mergebroker.merge.embedder import Embedder
from mergebroker.merge.grouping import needs_embedding
from mergebroker.merge.prompt import BLOCK_OVERHEAD_TOKENS
from mergebroker.providers.openai.batches import BatchApi
from mergebroker.providers.pool import ProviderPools
from mergebroker.token_usage import TokenUsage

log = structlog.get_logger(__name__)

__all__ = ["BulkJob", "BulkRunner", "JobSink", "Limits", "Result"]


@dataclass
class BulkJob:
    """One batch being run: who created it (tenant, tier, key limits), its lines, its window, its cancel signal."""

    batch_id: str
    caller: Caller
    lines: list[BatchLine]
    expires_at: float  # wall-clock seconds
    completion_window: str
    cancel: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def tenant(self) -> str:
        return self.caller.tenant

    @property
    def tier(self) -> str:
        return self.caller.tier


@dataclass(frozen=True)
class Limits:
    """The admission limits bulk calls are charged to, as live requests are: the tier's and the key's RPM/TPM."""

    limiter: Any  # broker.ratelimit.RateLimiter or its Redis twin: `reserve(specs, tokens) -> Reservation`
    specs: Callable[[Caller], list[LimitSpec]]


class JobSink(Protocol):
    """Where a job's results go (the batch service persists them and updates `request_counts`)."""

    async def record(self, job: BulkJob, results: list[Result], call: CallShare | None = None) -> None:
        """Keep these lines' results; a line already answered keeps its first result. `call`: the upstream call
        that answered them all; None for lines refused before any call."""


class BulkRunner:
    """Runs bulk jobs against the provider pools or the providers' Batch APIs."""

    def __init__(self, settings: Settings, *, pools: ProviderPools, store: BatchStore, batch_apis: dict[str, BatchApi],
                 limits: Limits, embedder: Embedder | None, merging_allowed: Callable[[str], bool], metrics: Metrics,
                 clock: Clock, sleep: Sleep, wall: Callable[[], float], costs: CostBook | None = None) -> None:
        self.settings = settings
        self.pools = pools
        self.store = store
        self.batch_apis = batch_apis
        self.limits = limits
        self.embedder = embedder
        self.merging_allowed = merging_allowed
        self.metrics = metrics
        self.clock = clock
        self.sleep = sleep
        self.wall = wall
        # Prices and limits (the broker's own `CostBook` where given, for one price table and calibration).
        self.costs = costs if costs is not None else CostBook(settings.price_table(), metrics=metrics, clock=clock)
        # The compacted calls in flight through the pools, shared by every job: many jobs never put more than
        # `batches.concurrency` bulk calls on the upstreams at once, and tenants take the slots in turn.
        self.slots = FairSlots(settings.batches.concurrency)

    async def run(self, job: BulkJob, sink: JobSink, answered: set[str]) -> None:
        """Answer every line of `job` not in `answered`, unless the job is cancelled or its window ends."""
        run = _Run(self, job, sink)
        try:
            await run.run(answered)
        finally:
            # The rounds' hooks are bound methods of `run`: this cycle would keep the job's lines and items
            # (~250,000 objects for 50,000 lines) alive until a full collection, which then stalls the loop
            # for ~0.3 s. Broken here, they die by reference counting when the job ends (`mergebroker.gc_policy`).
            run.rounds = None  # type: ignore[assignment]

    def api_for(self, model: str) -> BatchApi | None:
        """The Batch API of a provider serving `model` with `batch_api: true` (and not open), if any."""
        for upstream in self.pools.for_model(model):
            if upstream.name in self.batch_apis and not upstream.is_open():
                return self.batch_apis[upstream.name]
        return None


class BulkEconomics:
    """`merge.compaction.Economics` over the live path's `MergeEconomy`: one rule for what merging costs.

    The Batch API's own discount (half price at a provider's Batch API) scales a merged call's bill and its
    members' bills alone alike, so the comparison comes out the same at list prices: the price table
    decides as it does live. The capacity rule is left out (`rpm_pressure` 0): a bulk call has no deadline
    to keep, so it waits its turn under a binding RPM limit rather than pay a premium to merge, and a
    whole file is planned at once, long before the pressure it would read has any bearing on its calls.
    Each job plans with its own `MergeEconomy` (planning runs in a worker thread, and the economy's model
    of the provider's prompt cache is then the job's own: its first call warms the shared prefix).
    """

    def __init__(self, economy: MergeEconomy) -> None:
        self._economy = economy

    def split(self, model: str, system_prompt: str | None, members: Sequence[BulkItem], shared_tokens: int
              ) -> list[int]:
        candidates = [Candidate(m.prompt_tokens, max(0, m.prompt_tokens - shared_tokens), m.max_tokens)
                      for m in members]
        return self._economy.split(model, system_prompt, candidates, tag_tokens=BLOCK_OVERHEAD_TOKENS)

    def max_output_tokens(self, model: str) -> int | None:
        return self._economy.max_output_tokens(model)


class _Run:
    """The state of one job's run: its items by custom_id and the results it hands on."""

    def __init__(self, runner: BulkRunner, job: BulkJob, sink: JobSink) -> None:
        self.r = runner
        self.job = job
        self.sink = sink
        self.items: dict[str, BulkItem] = {}
        tier = runner.settings.tier(job.tier)
        merge = runner.settings.merge
        economy = economy_for(runner.settings, runner.costs, runner.clock)

        def window(model: str) -> int:  # the configured limit wins, then the price table's context window
            configured = merge.context_tokens.get(model)
            return configured if configured is not None else economy.context_window(model, merge.default_context_tokens)

        self.rules = CompactionRules(tier.similarity_threshold, tier.max_batch, window, merge.header,
                                     tier.system_prompts == "tagged", count_text_tokens, BulkEconomics(economy))
        self.alone = CompactionRules(0.0, 1, window, merge.header, self.rules.tagged_system, count_text_tokens)
        lowest = min(t.priority for t in runner.settings.tiers)
        self.rank = lambda: aged_rank(lowest, runner.clock(), runner.settings.server.aging_per_s)
        self.rounds = UpstreamRounds(batch_id=job.batch_id, completion_window=job.completion_window, cancel=job.cancel,
                                     store=runner.store, apis=runner.batch_apis,
                                     poll_interval_s=runner.settings.batches.poll_interval_s, sleep=runner.sleep,
                                     hooks=RoundHooks(self._direct, self._settle, self._count, self._stopped))

    async def run(self, answered: set[str]) -> None:
        todo = [line for line in self.job.lines if line.custom_id not in answered]
        models = {line.body["model"] for line in todo}  # routing and health are read here, on the loop
        served = frozenset(m for m in models if self.r.pools.serves(m))
        ctx = ItemContext(self.r.settings, self.job.tier, self.job.tenant, served,
                          frozenset(m for m in served if self.r.merging_allowed(m)))
        items, refused = await asyncio.to_thread(bulk_items, todo, ctx)
        del todo
        await self.sink.record(self.job, refused)
        self.items = {i.custom_id: i for i in items}
        alone_ids = set(await self.rounds.resume())
        done = await self.r.store.answered(self.job.batch_id)
        pending = [i for i in items if i.custom_id not in done]
        together = [i for i in pending if i.custom_id not in alone_ids]
        vectors = await self._vectors(together)
        number = await self.r.store.rounds_started(self.job.batch_id)
        calls = await asyncio.to_thread(self._plan, together, [i for i in pending if i.custom_id in alone_ids],
                                        vectors, number)
        del items, pending, together, vectors
        retry = await self._execute(calls, number)
        if retry and not self._stopped():
            again = [self.items[c] for c in retry]
            calls = await asyncio.to_thread(plan_compaction, again, self.alone, prefix=f"r{number + 1}")
            await self._execute(calls, number + 1)

    def _plan(self, together: list[BulkItem], alone: list[BulkItem], vectors: dict[str, Any] | None,
              number: int) -> list[PlannedCall]:
        # Block IDs come from `secrets`: no member can guess them.
        return (plan_compaction(together, self.rules, vectors=vectors, prefix=f"r{number}")
                + plan_compaction(alone, self.alone, prefix=f"r{number}a"))

    async def _vectors(self, items: list[BulkItem]) -> dict[str, Any] | None:
        embedder = self.r.embedder
        mergeable = [i for i in items if i.shape is not None]
        if not needs_embedding(len(mergeable), self.rules.threshold) or embedder is None or not embedder.ready:
            return None  # without vectors the planner sends a group that needs them unmerged
        vectors = await embedder.embed([i.shape.user_text for i in mergeable])  # type: ignore[union-attr]
        return {i.custom_id: v for i, v in zip(mergeable, vectors)}

    def _stopped(self) -> bool:
        return self.job.cancel.is_set() or self.r.wall() >= self.job.expires_at

    async def _execute(self, calls: list[PlannedCall], number: int) -> list[str]:
        """Send `calls` (each model its way); the custom_ids to re-run alone."""
        direct: list[PlannedCall] = []
        via: dict[str, list[PlannedCall]] = {}
        apis: dict[str, BatchApi] = {}
        for call in calls:
            api = self.r.api_for(call.model)
            if api is None:
                direct.append(call)
            else:
                apis[api.name] = api
                via.setdefault(api.name, []).append(call)
        parts = await asyncio.gather(self._direct(direct),
                                     *(self.rounds.send(apis[name], group, number) for name, group in via.items()))
        return [c for part in parts for c in part]

    async def _direct(self, calls: list[PlannedCall]) -> list[str]:
        """Send calls through the pools, each in its tenant's turn for a shared slot; nothing new once stopped.

        A few workers take the calls in order (never more than the slots: a job holds no task per call)."""
        retry: list[str] = []
        queue = iter(calls)

        async def worker() -> None:
            for call in queue:  # one iterator shared by the workers: each call is taken once
                if self._stopped():
                    return
                async with self.r.slots.slot(self.job.tenant):
                    if self._stopped():
                        return
                    outcome = await self._guarded_send(call)
                self._count("pool", call)
                retry.extend(await self._settle(call, outcome))

        await asyncio.gather(*(worker() for _ in range(min(len(calls), self.r.settings.batches.concurrency))))
        return retry

    async def _guarded_send(self, call: PlannedCall) -> Outcome:
        try:
            return await self._send(call)
        except Exception as exc:  # noqa: BLE001 - one call that breaks fails its own lines, not the job
            log.exception("bulk_call_failed", batch_id=self.job.batch_id, call_id=call.call_id)
            return BrokerError(f"The request could not be sent ({type(exc).__name__}).", status=500,
                               code="internal_error")

    async def _send(self, call: PlannedCall) -> Outcome:
        """One call through the pools, charged to the job's tier and key limits; while a limit or every
        upstream says wait, wait (within the window) and try again."""
        while True:
            try:
                reservation = await self.r.limits.limiter.reserve(self.r.limits.specs(self.job.caller), call.tokens)
            except RateLimited as exc:
                if exc.retry_after is None or self._stopped():  # larger than the whole limit: it never fits
                    return exc
                await sleep_or_event(self.r.sleep, exc.retry_after, self.job.cancel)
                continue
            outcome = await self._call_pools(call)
            await reservation.settle(_spent_tokens(outcome, call.tokens) if isinstance(outcome, dict) else 0)
            if not isinstance(outcome, UpstreamUnavailable) or self._stopped():
                return outcome
            await sleep_or_event(self.r.sleep, outcome.retry_after or 1.0, self.job.cancel)

    async def _call_pools(self, call: PlannedCall) -> Outcome:
        try:
            deadline = self.r.clock() + self.r.settings.batches.call_timeout_s
            reply, _ = await self.r.pools.chat(call.model, call.body, deadline=deadline, priority=self.rank(),
                                               tokens=call.tokens)
            return reply
        except BrokerError as exc:
            return exc

    async def _settle(self, call: PlannedCall, outcome: Outcome) -> list[str]:
        """Hand on the results a call's outcome gives; the custom_ids to re-run alone."""
        stop = self.items[call.members[0].custom_ids[0]].body.get("stop")
        leak_min_words = self.r.settings.merge.leak_min_words
        try:
            if call.merged:  # splitting and leak-checking a merged reply costs milliseconds: off the loop
                results, retry = await asyncio.to_thread(judge, call, outcome, stop=stop, leak_min_words=leak_min_words)
            else:
                results, retry = judge(call, outcome, stop=stop, leak_min_words=leak_min_words)
        except Exception:  # noqa: BLE001 - an outcome nobody foresaw fails this call's lines only
            log.exception("bulk_settle_failed", batch_id=self.job.batch_id, call_id=call.call_id)
            results, retry = failed(call.custom_ids, BrokerError("The reply could not be read.", status=502,
                                                                 code="upstream_bad_response")), {}
        for reason in retry.values():
            self.r.metrics.split_fallback.labels(reason).inc()
        # A restarted run plans its pool calls under the same names again: the suffix keeps each call's own.
        share = call_share(call, f"{self.job.batch_id}:{call.call_id}:{secrets.token_hex(4)}")
        await self.sink.record(self.job, results, share)
        return [c for m in call.members if m.tag in retry for c in m.custom_ids]

    def _count(self, mode: str, call: PlannedCall) -> None:
        self.r.metrics.bulk_upstream_requests.labels(mode, "merged" if call.merged else "single").inc()
        self.r.metrics.bulk_duplicate_lines.inc(sum(len(m.custom_ids) - 1 for m in call.members))


def _spent_tokens(reply: dict[str, Any], estimate: int) -> int:
    """The tokens a bulk call spent: what its reply reports, else the estimate it reserved."""
    usage = TokenUsage.from_body(reply)
    return usage.total_tokens if usage is not None and usage.total_tokens else estimate
