"""Run one bulk job: compact its unanswered lines, send the calls, settle the replies, re-run failures alone.

Deciding is pure (`merge.compaction.plan_compaction`, `merge.settle.settle_merged`); this module acts.
Round 0 sends the compacted plan; members whose block failed (or whose merged call failed) go to round 1,
planned with `max_batch=1`, where each line is a call of its own and any failure is that line's error.
Each model's calls go through a provider's own Batch API when one serving it has `batch_api: true`
(upload, create, poll, map back, cancel when the job is cancelled or its window ends), otherwise through
the provider pools at the lowest priority, within the providers' RPM/TPM, `batches.concurrency` calls at a
time across all jobs. Every line's result is handed to the `JobSink` as soon as it is known; the sink persists it, so a
restarted broker resumes with the lines still unanswered (and polls an upstream batch already submitted).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import structlog

from mergebroker.broker.engine.limits.admission import Caller
from mergebroker.broker.bulk.lines import BatchLine, jsonl
from mergebroker.broker.bulk.store import BatchStore, UpstreamRound
from mergebroker.merge.completion import member_completion
from mergebroker.broker.engine.chat.jobs import aged_rank
from mergebroker.broker.engine.metrics import Metrics
from mergebroker.broker.engine.limits.ratelimit import LimitSpec
from mergebroker.broker.engine.settings import Settings
from mergebroker.broker.engine.tokens import count_text_tokens, estimate_prompt_tokens
from mergebroker.clock import Clock, Sleep, sleep_or_event
from mergebroker.errors import (BrokerError, NotFound, RateLimited, UpstreamError, UpstreamHTTPError,
                               UpstreamUnavailable)
from mergebroker.merge.compaction import BulkItem, CompactionRules, PlannedCall, PlannedMember, plan_compaction
from mergebroker.merge.embedder import Embedder
from mergebroker.merge.fingerprint import chat_fingerprint
from mergebroker.merge.grouping import needs_embedding
from mergebroker.merge.settle import BAD_REPLY, SettleOptions, every_member, settle, settle_call_error
from mergebroker.merge.shape import compatibility_key, merge_shape
from mergebroker.merge.usage import largest_remainder
from mergebroker.providers.openai_batches import BatchApi
from mergebroker.providers.pool import ProviderPools
from mergebroker.providers.reply_usage import usage_tokens

log = structlog.get_logger(__name__)

CHAT_URL = "/v1/chat/completions"
FINAL_UPSTREAM = ("completed", "failed", "expired", "cancelled")
Result = tuple[str, int, dict[str, Any]]  # custom_id, HTTP status, body


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

    async def record(self, job: BulkJob, results: list[Result]) -> None:
        """Keep these lines' results; a line already answered keeps its first result."""


class BulkRunner:
    """Runs bulk jobs against the provider pools or the providers' Batch APIs."""

    def __init__(self, settings: Settings, *, pools: ProviderPools, store: BatchStore, batch_apis: dict[str, BatchApi],
                 limits: Limits, embedder: Embedder | None, merging_allowed: Callable[[str], bool], metrics: Metrics,
                 clock: Clock, sleep: Sleep, wall: Clock) -> None:
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
        self._slots: asyncio.Semaphore | None = None

    @property
    def slots(self) -> asyncio.Semaphore:
        """The compacted calls in flight through the pools, shared by every job: many jobs (or one tenant's
        many batches) never put more than `batches.concurrency` bulk calls on the upstreams at once."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.settings.batches.concurrency)
        return self._slots

    async def run(self, job: BulkJob, sink: JobSink, answered: set[str]) -> None:
        """Answer every line of `job` not in `answered`, unless the job is cancelled or its window ends."""
        await _Run(self, job, sink).run(answered)

    def api_for(self, model: str) -> BatchApi | None:
        """The Batch API of a provider serving `model` with `batch_api: true` (and not open), if any."""
        for upstream in self.pools.for_model(model):
            if upstream.name in self.batch_apis and not upstream.is_open():
                return self.batch_apis[upstream.name]
        return None


class _Run:
    """The state of one job's run: its items by custom_id and the results it hands on."""

    def __init__(self, runner: BulkRunner, job: BulkJob, sink: JobSink) -> None:
        self.r = runner
        self.job = job
        self.sink = sink
        self.items: dict[str, BulkItem] = {}
        tier = runner.settings.tier(job.tier)
        merge = runner.settings.merge
        self.rules = CompactionRules(tier.similarity_threshold, tier.max_batch,
                                     lambda model: merge.context_tokens.get(model, merge.default_context_tokens),
                                     merge.header, tier.system_prompts == "tagged")
        self.alone = CompactionRules(0.0, 1, self.rules.budget, merge.header, self.rules.tagged_system)
        lowest = min(t.priority for t in runner.settings.tiers)
        self.rank = lambda: aged_rank(lowest, runner.clock(), runner.settings.server.aging_per_s)

    async def run(self, answered: set[str]) -> None:
        todo = [line for line in self.job.lines if line.custom_id not in answered]
        models = {line.body["model"] for line in todo}  # routing and health are read here, on the loop
        served = {m for m in models if self.r.pools.serves(m)}
        mergeable = {m for m in served if self.r.merging_allowed(m)}
        items, refused = await asyncio.to_thread(self._items, todo, served, mergeable)
        await self.sink.record(self.job, refused)
        self.items = {i.custom_id: i for i in items}
        alone_ids = set(await self._resume_rounds())
        done = set(await self.r.store.results(self.job.batch_id))
        pending = [i for i in items if i.custom_id not in done]
        vectors = await self._vectors([i for i in pending if i.custom_id not in alone_ids])
        number = await self.r.store.rounds_started(self.job.batch_id)
        calls = (plan_compaction([i for i in pending if i.custom_id not in alone_ids], self.rules, vectors=vectors,
                                 prefix=f"r{number}")  # block IDs from `secrets`: no member can guess them
                 + plan_compaction([i for i in pending if i.custom_id in alone_ids], self.alone, prefix=f"r{number}a"))
        retry = await self._execute(calls, number)
        if retry and not self._stopped():
            await self._execute(plan_compaction([self.items[c] for c in retry], self.alone, prefix=f"r{number + 1}"),
                                number + 1)

    def _items(self, lines: Sequence[BatchLine], served: set[str],
               mergeable: set[str]) -> tuple[list[BulkItem], list[Result]]:
        """Each line as the planner sees it (token counts are the cost, so this runs in a worker thread);
        lines for models no provider serves get their 404 at once."""
        settings = self.r.settings
        tier = settings.tier(self.job.tier)
        merging = settings.merge.enabled and tier.merge
        items, refused = [], []
        for line in lines:
            body = line.body
            model = body["model"]
            if model not in served:
                refused.append((line.custom_id, 404, NotFound(f"The model '{model}' does not exist or you do not "
                                                              "have access to it.", param="model",
                                                              code="model_not_found").body()))
                continue
            if tier.omitted_temperature_is_zero and body.get("temperature") is None:
                body = {**body, "temperature": 0}
            shape = merge_shape(body) if merging and line.mergeable and model in mergeable else None
            scope = self._scope(body)
            key = (compatibility_key(body, shape, scope_value=scope, include_system=tier.system_prompts == "exact")
                   if shape else None)
            fingerprint = scope + ":" + chat_fingerprint(
                body, lowercase=settings.merge.lowercase, collapse_whitespace=settings.merge.collapse_whitespace,
                cache_version=settings.merge.cache_version)
            max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens")
                             or settings.merge.default_max_tokens)
            items.append(BulkItem(line.custom_id, body, fingerprint, shape, key, estimate_prompt_tokens(body["messages"]),
                                  count_text_tokens(shape.user_text) if shape else 0, max_tokens))
        return items, refused

    def _scope(self, body: dict[str, Any]) -> str:
        # Lines of one file share a tenant; with `merge.scope: user` their end users must not share a call.
        if self.r.settings.merge.scope == "user":
            return "user:" + json.dumps([self.job.tenant, body.get("user") or ""])
        return "tenant:" + json.dumps(self.job.tenant)

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
                                     *(self._via_api(apis[name], group, number) for name, group in via.items()))
        return [c for part in parts for c in part]

    async def _direct(self, calls: list[PlannedCall]) -> list[str]:
        """Send calls through the pools, within the shared bulk concurrency; nothing new once stopped."""
        retry: list[str] = []

        async def one(call: PlannedCall) -> None:
            async with self.r.slots:
                if self._stopped():
                    return
                outcome = await self._send(call)
            self._count("pool", call)
            retry.extend(await self._settle(call, outcome))

        async with asyncio.TaskGroup() as group:  # a failure stops the others: the job fails as a whole
            for call in calls:
                group.create_task(one(call))
        return retry

    async def _send(self, call: PlannedCall) -> dict[str, Any] | BrokerError:
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
            await reservation.settle((usage_tokens(outcome) or call.tokens) if isinstance(outcome, dict) else 0)
            if not isinstance(outcome, UpstreamUnavailable) or self._stopped():
                return outcome
            await sleep_or_event(self.r.sleep, outcome.retry_after or 1.0, self.job.cancel)

    async def _call_pools(self, call: PlannedCall) -> dict[str, Any] | BrokerError:
        try:
            deadline = self.r.clock() + self.r.settings.batches.call_timeout_s
            reply, _ = await self.r.pools.chat(call.model, call.body, deadline=deadline, priority=self.rank(),
                                               tokens=call.tokens)
            return reply
        except BrokerError as exc:
            return exc

    async def _settle(self, call: PlannedCall, outcome: dict[str, Any] | BrokerError) -> list[str]:
        """Hand on the results a call's outcome gives; the custom_ids to re-run alone."""
        results, retry = self._judge(call, outcome)
        for reason in retry.values():
            self.r.metrics.split_fallback.labels(reason).inc()
        await self.sink.record(self.job, results)
        return [c for m in call.members if m.tag in retry for c in m.custom_ids]

    def _judge(self, call: PlannedCall, outcome: dict[str, Any] | BrokerError) -> tuple[list[Result], dict[str, str]]:
        """Results per line, and the members (by tag) to re-run alone with the reason."""
        if not call.merged:
            if isinstance(outcome, BrokerError):
                return [(c, outcome.status, outcome.body()) for c in call.custom_ids], {}
            return _shared(call.members[0], outcome), {}
        stop = self.items[call.members[0].custom_ids[0]].body.get("stop")
        members = [m.settle_member(stop) for m in call.members]
        if isinstance(outcome, BrokerError):
            settlement = settle_call_error(outcome, members)
        else:
            try:
                settlement = settle(outcome, members, SettleOptions(self.r.settings.merge.leak_min_words))
            except Exception:  # noqa: BLE001 - a reply we cannot read must not cost the members their answers
                log.exception("merged_reply_unreadable", batch_id=self.job.batch_id, call_id=call.call_id)
                settlement = every_member(members, BAD_REPLY)
        results: list[Result] = []
        for m in call.members:
            answer = settlement.answers.get(m.tag)  # type: ignore[arg-type]
            error = settlement.errors.get(m.tag)  # type: ignore[arg-type]
            if answer is not None:
                results += _shared(m, member_completion(outcome, answer.text, answer.usage))  # type: ignore[arg-type]
            elif error is not None:
                results += [(c, error.status, error.body()) for c in m.custom_ids]
        return results, settlement.fallbacks

    def _count(self, mode: str, call: PlannedCall) -> None:
        self.r.metrics.bulk_upstream_requests.labels(mode, "merged" if call.merged else "single").inc()
        self.r.metrics.bulk_duplicate_lines.inc(sum(len(m.custom_ids) - 1 for m in call.members))

    async def _via_api(self, api: BatchApi, calls: list[PlannedCall], number: int) -> list[str]:
        """Send calls as one upstream batch; if it cannot be submitted, send them through the pools."""
        if self._stopped():
            return []
        data = jsonl({"custom_id": c.call_id, "method": "POST", "url": CHAT_URL, "body": c.body} for c in calls)
        try:
            file_id = await api.upload(data, filename=f"{self.job.batch_id}-{number}.jsonl")
            upstream = await api.create_batch(file_id, endpoint=CHAT_URL, completion_window=self.job.completion_window)
        except UpstreamError as exc:
            log.warning("upstream_batch_refused", batch_id=self.job.batch_id, provider=api.name,
                        error=type(exc).__name__)
            return await self._direct(calls)
        found = UpstreamRound(number, api.name, upstream["id"], [c.to_json() for c in calls])
        await self.r.store.put_round(self.job.batch_id, found)
        return await self._collect(api, found)

    async def _resume_rounds(self) -> list[str]:
        """Map back the upstream batches a previous run submitted; the custom_ids to re-run alone."""
        retry: list[str] = []
        for found in await self.r.store.open_rounds(self.job.batch_id):
            api = self.r.batch_apis.get(found.provider)
            if api is None:  # the provider is no longer configured for batches: its lines are planned again
                await self.r.store.finish_round(self.job.batch_id, found)
                continue
            retry += await self._collect(api, found)
        return retry

    async def _collect(self, api: BatchApi, found: UpstreamRound) -> list[str]:
        """Poll an upstream batch to its end, then settle every call it answered."""
        upstream = await self._poll(api, found.upstream_id)
        replies: dict[str, tuple[int, dict[str, Any]]] = {}
        for key in ("output_file_id", "error_file_id"):
            if upstream.get(key):
                replies.update(_read_output(await api.content(upstream[key])))
        retry: list[str] = []
        for data in found.calls:
            call = PlannedCall.from_json(data)
            if call.call_id not in replies:
                continue  # cancelled or expired upstream before it ran: the line stays unanswered
            status, body = replies[call.call_id]
            self._count("batch_api", call)
            outcome = body if status == 200 else UpstreamHTTPError(status, _message(body), body=body)
            retry += await self._settle(call, outcome)
        await self.r.store.finish_round(self.job.batch_id, found)
        return retry

    async def _poll(self, api: BatchApi, upstream_id: str) -> dict[str, Any]:
        """Retrieve the upstream batch until it ends; cancel it when the job is cancelled or its window ends."""
        asked_cancel = False
        interval = self.r.settings.batches.poll_interval_s
        while True:
            try:
                upstream = await api.retrieve_batch(upstream_id)
                if upstream.get("status") in FINAL_UPSTREAM:
                    return upstream
                if self._stopped() and not asked_cancel:
                    await api.cancel_batch(upstream_id)
                    asked_cancel = True
            except UpstreamError as exc:
                log.warning("upstream_batch_poll_failed", batch_id=self.job.batch_id, error=type(exc).__name__)
            waker = asyncio.Event() if asked_cancel else self.job.cancel
            await sleep_or_event(self.r.sleep, interval, waker)


def _shared(member: PlannedMember, body: dict[str, Any]) -> list[Result]:
    """One member's completion for each of its identical lines, the call's usage split evenly among them."""
    ids = member.custom_ids
    usage = body.get("usage")
    if len(ids) == 1 or not isinstance(usage, dict):
        return [(c, 200, body) for c in ids]
    ones = [1] * len(ids)
    prompts = largest_remainder(_count(usage.get("prompt_tokens")), ones)
    completions = largest_remainder(_count(usage.get("completion_tokens")), ones)
    return [(c, 200, {**body, "usage": {"prompt_tokens": p, "completion_tokens": o, "total_tokens": p + o}})
            for c, p, o in zip(ids, prompts, completions)]


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _read_output(raw: bytes) -> dict[str, tuple[int, dict[str, Any]]]:
    """custom_id -> (status, body) from an upstream batch's output or error file; unreadable lines are skipped."""
    found: dict[str, tuple[int, dict[str, Any]]] = {}
    for line in raw.decode("utf-8", "replace").splitlines():
        try:
            data = json.loads(line)
            response = data.get("response") or {}
            body = response.get("body") if isinstance(response.get("body"), dict) else {"error": data.get("error")}
            found[str(data["custom_id"])] = (int(response.get("status_code") or 500), body)
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return found


def _message(body: dict[str, Any]) -> str:
    error = body.get("error")
    return str(error.get("message")) if isinstance(error, dict) and error.get("message") else "upstream batch line failed"
