"""Shadow comparison: re-send a sample of merged members alone, off the caller's path, and score the merge.

The dispatcher calls `ShadowRunner.offer(job, answer, batch_size)` for every member it answered from a
merged call; the caller already has its answer. Of the deterministic ones (temperature 0: at any other
temperature two alone answers differ too), a fraction `rate` is sent again, alone, at the
lowest priority at the upstream limiter, at most `max_in_flight` at a time and within `tpm` tokens per
minute (reserved before the call, settled with the reported usage). The two answers are compared by
`merge.fidelity` (prose by the cosine of the broker's own similarity model, when it is loaded), and the
score goes to the `merge_fidelity` histogram, to the quality guard of the member's tenant and model, and
to the ledger as a record with `endpoint="shadow"`, so `mergebroker report` shows what shadowing costs.
`shadow_total{result}` counts every offer that was sampled: agree, differ, failed, over_budget, busy.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Callable

import structlog

from mergebroker.broker.engine.accounting.ledger import LedgerRecord
from mergebroker.broker.engine.chat.jobs import ChatJob
from mergebroker.broker.engine.ground.metrics import Metrics
from mergebroker.clock import Clock, monotonic
from mergebroker.errors import BrokerError
from mergebroker.merge.embedder import Embedder
from mergebroker.merge.fidelity import compare, needs_cosine
from mergebroker.merge.quality_guard import QualityGuard
from mergebroker.merge.settle import reply_text
from mergebroker.providers.pool import ProviderPools
from mergebroker.providers.token_bucket import TokenBucket
from mergebroker.token_usage import NO_USAGE, TokenUsage

log = structlog.get_logger(__name__)

LOWEST_PRIORITY = float("-inf")
AGREE_AT = 0.9
"""A comparison scoring at least this counts as `agree` in `shadow_total` (the histogram keeps the score)."""
SHADOW_TIMEOUT_S = 60.0


class ShadowRunner:
    """Samples merged members, re-sends them alone in the background and records how close the answers were."""

    def __init__(self, pools: ProviderPools, *, rate: float, tpm: int, guard: QualityGuard, metrics: Metrics,
                 embedder: Embedder | None = None, record: Callable[[LedgerRecord], None] | None = None,
                 max_in_flight: int = 4, clock: Clock = monotonic, rng: random.Random | None = None) -> None:
        self._pools = pools
        self._rate = rate
        self._budget = TokenBucket(tpm, tpm / 60, clock) if tpm > 0 else None
        self._guard = guard
        self._metrics = metrics
        self._embedder = embedder
        self._record = record
        self._max_in_flight = max_in_flight
        self._clock = clock
        self._rng = rng or random.Random()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def enabled(self) -> bool:
        """Whether any member can be sampled."""
        return self._rate > 0 and self._budget is not None

    def offer(self, job: ChatJob, merged_answer: str, batch_size: int) -> None:
        """Maybe shadow this member (answered from a merged call of `batch_size`); never blocks, never raises."""
        # At a temperature above 0 the alone answer differs from the merged one by sampling alone: only
        # deterministic requests can say whether merging changed the answer.
        if not self.enabled or job.body.get("temperature") != 0 or self._rng.random() >= self._rate:
            return
        if len(self._tasks) >= self._max_in_flight:
            self._count("busy")
            return
        reserved = job.reserved_tokens
        if not self._budget.try_take(reserved):  # type: ignore[union-attr]
            self._count("over_budget")
            return
        task = asyncio.get_running_loop().create_task(self._shadow(job, merged_answer, batch_size, reserved))
        self._tasks.add(task)
        task.add_done_callback(self._done)

    async def drain(self) -> None:
        """Wait until the shadow calls in flight now have finished (for tests and orderly shutdowns)."""
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def close(self) -> None:
        """Cancel the shadow calls in flight (at shutdown nobody waits for them)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _shadow(self, job: ChatJob, merged_answer: str, batch_size: int, reserved: int) -> None:
        started = self._clock()
        try:
            reply, _ = await self._pools.chat(job.model, job.body, deadline=started + SHADOW_TIMEOUT_S,
                                              priority=LOWEST_PRIORITY, tokens=reserved)
        except BrokerError as exc:
            self._budget.give_back(reserved)  # type: ignore[union-attr]
            self._count("failed")
            log.info("shadow_failed", request_id=job.request_id, error=type(exc).__name__)
            return
        usage = TokenUsage.from_body(reply) or NO_USAGE
        prompt, completion = usage.prompt_tokens, usage.completion_tokens
        self._settle(reserved, prompt + completion)
        read = reply_text(reply)
        if read is None:
            self._count("failed")
            return
        score = await self._score(merged_answer, read[0])
        self._metrics.merge_fidelity.labels(job.tier, self._metrics.model_label(job.model),
                                            str(batch_size)).observe(score)
        self._count("agree" if score >= AGREE_AT else "differ")
        self._guard.record_fidelity(job.caller.tenant, job.model, score)
        if self._record is not None:
            self._record(_ledger_record(job, prompt, completion, (self._clock() - started) * 1000))

    async def _score(self, merged: str, alone: str) -> float:
        cosine = None
        if needs_cosine(merged, alone) and self._embedder is not None and self._embedder.ready:
            try:
                vectors = await self._embedder.embed([merged, alone])
                cosine = float(vectors[0] @ vectors[1])
            except Exception as exc:  # noqa: BLE001 - without the model, word overlap stands in
                log.warning("shadow_embedding_failed", error=type(exc).__name__)
        return compare(merged, alone, cosine=cosine).score

    def _settle(self, reserved: int, used: int) -> None:
        if used > reserved:
            self._budget.take(used - reserved)  # type: ignore[union-attr]
        elif used:
            self._budget.give_back(reserved - used)  # type: ignore[union-attr]

    def _count(self, result: str) -> None:
        self._metrics.shadow.labels(result).inc()

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("shadow_crashed", error=repr(task.exception()))


def _ledger_record(job: ChatJob, prompt: int, completion: int, latency_ms: float) -> LedgerRecord:
    """A shadow call's ledger record: billed like a call of its own, saving nothing."""
    return LedgerRecord(request_id="shadow-" + uuid.uuid4().hex, ts=time.time(), tenant=job.caller.tenant,
                        tier=job.tier, model=job.model, batch_id=None, batch_size=1, cache="miss",
                        prompt_tokens=prompt, completion_tokens=completion, alone_prompt_tokens=prompt,
                        tokens_saved=0, status=200, latency_ms=latency_ms, endpoint="shadow")
