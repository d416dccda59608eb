"""No job goes upstream twice: a worker back from a pause sends nothing another took over, a job that went
upstream is never claimed from a live (even paused) worker, a dead worker's jobs move at once, and a
front-end that loses Redis keeps waiting for what a worker already sent. Real Redis, parts driven by hand."""

from __future__ import annotations

import asyncio

import pytest

from mergebroker.broker.cluster.client import make_stream_client
from mergebroker.broker.cluster.frontend import ClusterQueue
from mergebroker.broker.cluster.holds import FENCE_SHARE
from mergebroker.broker.cluster.partition import GROUP
from mergebroker.broker.cluster.presence import DeathWatch, Presence, absent_workers, make_presence_client
from mergebroker.broker.cluster.server_time import ServerClock
from mergebroker.broker.engine.chat.job_queue import FakeJobQueue
from mergebroker.broker.engine.ground.metrics import Metrics
from mergebroker.clock import FakeClock
from tests.broker.cluster.test_cluster_streams import KEYS, SETTINGS, Node, answer, chat_job, next_job, read_by
from tests.helpers.polling import wait_until

pytestmark = pytest.mark.redis


@pytest.fixture
async def parts(redis_server):
    """A stream client on the test's Redis, and a maker of started front-end queues (stopped at the end)."""
    client = make_stream_client(redis_server.url, block_ms=SETTINGS.block_ms)
    queues: list[ClusterQueue] = []

    def frontend() -> ClusterQueue:
        queue = ClusterQueue(client, FakeJobQueue(), keys=KEYS, settings=SETTINGS, partitions=SETTINGS.partitions,
                             server_clock=ServerClock(), metrics=Metrics(), frontend_id=f"f{len(queues)}")
        queue.start()
        queues.append(queue)
        return queue

    yield client, frontend
    for queue in queues:
        await queue.stop()
    await client.aclose()

CLAIMABLE_MS = SETTINGS.claim_idle_ms * 2


def content(outcome) -> str:
    return outcome.body["choices"][0]["message"]["content"]


async def hand_over(redis, to: Node) -> None:
    """Every partition moves to `to` (the leases of a paused worker lapsed)."""
    await redis.delete(*[KEYS.lease(p) for p in range(SETTINGS.partitions)])
    await to.leases.renew()
    await to.consumer._ensure_groups(to.consumer.streams())


async def test_a_paused_workers_unsent_job_moves_to_another_and_the_paused_one_never_sends_it(parts):
    redis, frontend = parts
    clock = FakeClock()
    a, b = Node(redis, "wa", clock), Node(redis, "wb", clock)
    await a.leases.renew()
    future, job_at_a = await read_by(a, frontend(), "waiting in a merge window when a froze")
    stream, entry = next(iter(a.consumer._held))
    clock.advance(SETTINGS.claim_idle_ms * FENCE_SHARE / 1000)  # a froze: no heartbeat for two periods
    assert job_at_a.future.cancelled() and a.consumer.held == 0  # fenced: the engine drops it unsent
    await hand_over(redis, b)
    await redis.xclaim(stream, GROUP, "wa", 0, [entry], idle=CLAIMABLE_MS, justid=True)  # idle, as Redis sees it
    assert await b.consumer.claim_once() == 1
    answer(await next_job(b.queue), "answered by b")
    await b.write()
    assert content(await asyncio.wait_for(future, 10)) == "answered by b"
    assert a.metrics.cluster_jobs.labels("fenced")._value.get() == 1


async def test_a_job_sent_upstream_before_its_worker_froze_is_never_claimed_while_that_worker_lives(parts):
    redis, frontend = parts
    clock = FakeClock()
    a, b = Node(redis, "wa", clock), Node(redis, "wb", clock)
    await a.leases.renew()
    future, job = await read_by(a, frontend(), "in flight upstream when a froze")
    job.mark_sent()  # the engine's last step before the upstream call: the marker and the note follow
    await a.write_notes()
    stream, entry = next(iter(a.consumer._held))
    clock.advance(SETTINGS.claim_idle_ms / 1000)  # frozen past the fence: a sent job is kept, not dropped
    assert a.consumer.held == 1 and not job.future.done()
    await hand_over(redis, b)
    await redis.xclaim(stream, GROUP, "wa", 0, [entry], idle=CLAIMABLE_MS, justid=True)
    assert await b.consumer.claim_once() == 0 and b.queue.jobs == []  # its marker: b does not run it again
    answer(job, "answered by a, once")  # a resumes; its upstream reply had arrived meanwhile
    await a.write()
    assert content(await asyncio.wait_for(future, 10)) == "answered by a, once"


async def test_a_worker_back_from_a_pause_does_not_take_back_an_entry_another_claimed(parts):
    redis, frontend = parts
    a = Node(redis, "wa", FakeClock())
    await a.leases.renew()
    _future, job = await read_by(a, frontend(), "claimed away")
    stream, entry = next(iter(a.consumer._held))
    await redis.xclaim(stream, GROUP, "wb", 0, [entry], justid=True)  # b claimed it while a was cut off
    await a.consumer.heartbeat_once()
    assert job.future.cancelled() and a.consumer.held == 0
    assert (await redis.xpending_range(stream, GROUP, "-", "+", 10))[0]["consumer"] == b"wb"  # still b's
    assert a.metrics.cluster_jobs.labels("taken_over")._value.get() == 1


async def test_a_dead_workers_jobs_are_claimed_at_once_even_those_it_sent(redis_server, parts):
    redis, frontend = parts
    clock = FakeClock()
    a, b = Node(redis, "wa", clock), Node(redis, "wb", clock)
    presence = Presence(make_presence_client(redis_server.url, "wa"), KEYS, "wa")
    await presence.refresh()
    await a.leases.renew()
    future, job = await read_by(a, frontend(), "in flight upstream when a was killed")
    job.mark_sent()
    await a.write_notes()
    assert await absent_workers(redis, KEYS, me="wb") == set()  # a lives (paused or not): its connection is open
    await presence.aclose()  # kill -9: the kernel closes the process's sockets
    # Redis drops the client as it reads the close: no event to wait on
    await wait_until(lambda: absent_workers(redis, KEYS, me="wb"), 10, "Redis never dropped the closed client")
    watch = DeathWatch(confirm_s=0.5)
    assert watch.observe({"wa"}, 0.0) == set()  # one miss may be a reconnect: wait for the second
    assert watch.observe({"wa"}, 0.5) == {"wa"}
    b.consumer.mark_dead({"wa"})
    assert await b.leases.forget({"wa"}) == SETTINGS.partitions  # its leases go at once, not after lease_ms
    await b.leases.renew()
    assert b.leases.owned == frozenset(range(SETTINGS.partitions))
    await b.consumer._ensure_groups(b.consumer.streams())
    assert await b.consumer.claim_once() == 1  # idle for milliseconds only, and sent: claimed all the same
    answer(await next_job(b.queue), "answered by b")
    await b.write()
    assert content(await asyncio.wait_for(future, 10)) == "answered by b"


async def test_a_front_end_that_loses_redis_serves_only_what_no_worker_sent(redis_server, parts):
    redis, frontend = parts
    node = Node(redis, "w1", FakeClock())
    await node.leases.renew()
    fe = frontend()
    sent_future, unsent_future = fe.submit(chat_job("already upstream")), fe.submit(chat_job("still in a window"))
    await node.read_jobs(2)
    sent_job, unsent_job = sorted(await node.queue.wait_for(2), key=lambda j: j.request_id)
    sent_job.mark_sent()
    await node.write_notes()
    await wait_until(lambda: fe._inflight.senders() == {"w1"}, 10, "the reply loop never read the sent note")
    redis_server.stop()  # killed: the streams are lost with it
    await wait_until(lambda: fe.in_fallback, 10, "the front-end never noticed", interval_s=0)
    assert node.consumer.fence_all() == 1 and unsent_job.future.cancelled()  # the worker does not run the other
    redis_server.start()  # back, empty: the hand-over finds no note for the other one, and serves it here
    local: FakeJobQueue = fe._local  # type: ignore[assignment]
    moved = await next_job(local)
    assert moved.request_id == "r-still in a window" and len(local.jobs) == 1  # the sent one is not run here too
    answer(moved, "served by the front-end")
    assert content(await asyncio.wait_for(unsent_future, 10)) == "served by the front-end"
    answer(sent_job, "answered by the worker after the outage")
    await node.write()  # the worker's reply waited for Redis
    assert content(await asyncio.wait_for(sent_future, 30)) == "answered by the worker after the outage"
    assert fe._metrics.cluster_duplicates_dropped._value.get() == 0 and len(local.jobs) == 1
