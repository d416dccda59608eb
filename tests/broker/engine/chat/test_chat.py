"""ChatService over the queue seam alone: identical requests share one job, followers extend it, refusals reach the caller."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from mergebroker.broker.engine.chat.job_queue import FakeJobQueue
from mergebroker.broker.engine.chat.jobs import ChatOutcome
from mergebroker.broker.engine.chat.service import CacheControl, ChatService
from mergebroker.broker.engine.ground.config import load_settings
from mergebroker.broker.engine.ground.metrics import Metrics
from mergebroker.broker.engine.limits.admission import Caller
from mergebroker.broker.engine.limits.limiter import FakeLimiter
from mergebroker.clock import FakeClock
from mergebroker.errors import Overloaded, RateLimited, UpstreamUnavailable
from mergebroker.providers.fake import FakePool

CALLER = Caller("acme", "standard")
BODY = {"model": "sim-small", "messages": [{"role": "user", "content": "the same question"}]}


def service(queue: FakeJobQueue, clock: FakeClock, limiter: FakeLimiter | None = None,
            pool: FakePool | None = None) -> ChatService:
    settings = load_settings(None, environ={}, overrides={
        "merge": {"embedder": "none"}, "cache": {"enabled": False},
        "tiers": [{"name": "standard", "window_ms": 50}], "default_tier": "standard"})
    return ChatService(settings, queue=queue, pools=pool or FakePool(), limiter=limiter or FakeLimiter(),
                       cache=None, metrics=Metrics(), clock=clock)


def ask(chat: ChatService, request_id: str, timeout_s: float | None = None) -> asyncio.Task[Any]:
    return asyncio.ensure_future(chat.complete(CALLER, request_id, BODY, timeout_s=timeout_s, merge_opt_out=False,
                                               cache_control=CacheControl()))


def outcome(text: str) -> ChatOutcome:
    return ChatOutcome({"choices": [{"message": {"content": text}, "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}, "fake", 0.1)


async def test_identical_requests_in_flight_share_one_queued_job():
    queue, clock = FakeJobQueue(), FakeClock()
    chat = service(queue, clock)
    leader, follower = ask(chat, "r1"), ask(chat, "r2")
    (job,) = await queue.wait_for(1)
    await queue.wait_until(lambda: queue.extensions)  # the follower joined the pending flight
    queue.answer(job, outcome("shared"))
    first, second = await leader, await follower
    assert len(queue.jobs) == 1
    assert (first.cache, second.cache) == ("miss", "coalesced")
    assert second.outcome.body["choices"][0]["message"]["content"] == "shared"


async def test_a_follower_extends_the_pending_jobs_deadline_through_the_queue():
    queue, clock = FakeJobQueue(), FakeClock()
    chat = service(queue, clock)
    leader = ask(chat, "r1", timeout_s=2)
    (job,) = await queue.wait_for(1)
    assert job.deadline == clock() + 2
    follower = ask(chat, "r2", timeout_s=20)
    await queue.wait_until(lambda: queue.extensions)
    assert job.deadline == clock() + 20
    queue.answer(job, outcome("late but in time"))
    assert (await follower).cache == "coalesced"
    await leader


async def test_a_job_already_sent_keeps_its_deadline():
    queue, clock = FakeJobQueue(), FakeClock()
    chat = service(queue, clock)
    leader = ask(chat, "r1", timeout_s=2)
    (job,) = await queue.wait_for(1)
    sent_with = job.mark_sent()
    assert queue.extend(job, clock() + 20) is False and job.deadline == sent_with
    queue.answer(job, outcome("done"))
    await leader


async def test_a_full_queue_refuses_the_caller_and_gives_back_its_reserved_budget():
    queue, clock, limiter = FakeJobQueue(capacity=0), FakeClock(), FakeLimiter()
    chat = service(queue, clock, limiter)
    with pytest.raises(Overloaded) as refused:
        await ask(chat, "r1")
    assert refused.value.code == "queue_full" and queue.jobs == []
    ((_, reserved),) = limiter.reserved
    assert limiter.returned == [reserved]


async def test_the_reservation_settles_with_the_answers_real_usage():
    queue, clock, limiter = FakeJobQueue(), FakeClock(), FakeLimiter()
    chat = service(queue, clock, limiter)
    caller = ask(chat, "r1")
    (job,) = await queue.wait_for(1)
    queue.answer(job, outcome("seven tokens in all"))
    await caller
    ((_, reserved),) = limiter.reserved
    assert limiter.returned == [reserved - 7]


async def test_a_rate_limited_or_fast_failed_caller_never_reaches_the_queue():
    queue, clock = FakeJobQueue(), FakeClock()
    with pytest.raises(RateLimited):
        await ask(service(queue, clock, FakeLimiter(refuse=RateLimited("slow down", retry_after=1))), "r1")
    with pytest.raises(UpstreamUnavailable):
        await ask(service(queue, clock, pool=FakePool(fast_fail=5.0)), "r2")
    assert queue.jobs == []


async def test_when_every_caller_leaves_the_job_is_cancelled_for_the_queue_to_drop():
    queue, clock = FakeJobQueue(), FakeClock()
    chat = service(queue, clock)
    caller = ask(chat, "r1")
    (job,) = await queue.wait_for(1)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert job.future.cancelled() and queue.depth("standard") == 0
