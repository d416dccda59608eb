"""Cluster mode's parts in one process on a real Redis: a job's round trip, coalescing across front-ends,
leases, heartbeats against claims, first-reply-wins and the fallback when Redis goes away."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from mergebroker.broker.cluster.client import make_stream_client
from mergebroker.broker.cluster.consumer import StreamConsumer
from mergebroker.broker.cluster.frontend import ClusterQueue
from mergebroker.broker.cluster.leases import PartitionLeases
from mergebroker.broker.cluster.partition import GROUP, Keys
from mergebroker.broker.cluster.server_time import ServerClock
from mergebroker.broker.cluster.wire import WireReply, encode_job, encode_reply
from mergebroker.broker.engine.chat.job_queue import FakeJobQueue
from mergebroker.broker.engine.chat.jobs import ChatJob, ChatOutcome
from mergebroker.broker.engine.ground.metrics import Metrics
from mergebroker.broker.engine.ground.settings import ClusterSettings, default_tiers
from mergebroker.broker.engine.limits.admission import Caller
from mergebroker.clock import Clock, FakeClock, monotonic
from mergebroker.token_usage import TokenUsage
from tests.helpers.polling import wait_until

pytestmark = pytest.mark.redis

# Most tests drive a front-end with no worker process: its no-worker fallback is tested on its own.
SETTINGS = ClusterSettings(enabled=True, partitions=4, claim_idle_ms=5000, lease_ms=3000, block_ms=100, prefetch=16,
                           local_without_workers=False)
KEYS = Keys("mbt")


def chat_job(text: str, *, deadline_s: float = 30.0, tenant: str = "t", merge_key: str | None = None,
             clock: Clock = monotonic) -> ChatJob:
    """A job queued now on `clock`: the real one for a front-end (which reads Redis time through it),
    the test's fake one for a dispatcher driven by it."""
    body = {"model": "m", "messages": [{"role": "user", "content": text}]}
    return ChatJob(request_id="r-" + text, caller=Caller(tenant, "batch"), body=body, model="m", priority=0.0,
                   shape=None, merge_key=merge_key or "mk-" + text, prompt_tokens=5, max_tokens=10,
                   deadline=clock() + deadline_s, enqueued_at=clock())


def answer(job: ChatJob, text: str) -> None:
    FakeJobQueue().answer(job, ChatOutcome({"choices": [{"message": {"content": text}}]}, "sim", 0.01))


async def next_job(queue: FakeJobQueue, seen: int = 0) -> ChatJob:
    """The job after the first `seen` that reached `queue`."""
    return (await asyncio.wait_for(queue.wait_for(seen + 1), 10))[seen]


async def read_by(node: Node, fe: ClusterQueue, text: str) -> tuple[asyncio.Future, ChatJob]:
    """The future of a job submitted at `fe`, and that job as `node` (holding its partition) read it."""
    future = fe.submit(chat_job(text))
    await node.read_jobs()
    return future, await next_job(node.queue)


async def read_by_a_worker(redis, fe: ClusterQueue, text: str) -> tuple[Node, asyncio.Future, ChatJob]:
    """A fresh worker holding every partition, and `read_by` it."""
    node = Node(redis, "w1", FakeClock())
    await node.leases.renew()
    return (node, *await read_by(node, fe, text))


class Node:
    """One worker's parts, driven by hand: leases renewed and reads, writes, claims called by the test."""

    def __init__(self, redis, name: str, clock: FakeClock, tiers=None, settings: ClusterSettings = SETTINGS) -> None:
        self.clock = clock
        self.queue = FakeJobQueue()
        self.metrics = Metrics()
        server_clock = ServerClock(clock)  # one local clock for both, as a worker process has (`start_worker`)
        self.leases = PartitionLeases(redis, KEYS, name, partitions=SETTINGS.partitions, lease_ms=SETTINGS.lease_ms,
                                      server_clock=server_clock, clock=clock)
        self.consumer = StreamConsumer(redis, self.queue, keys=KEYS, settings=settings, tiers=tiers or default_tiers(),
                                       leases=self.leases, server_clock=server_clock, consumer_id=name,
                                       aging_per_s=10.0, metrics=self.metrics, clock=clock)

    async def write(self) -> None:
        """Write until an answer went out (its sent note may go first: the answer reaches the outbox in the
        future's callback, a loop turn later)."""
        async def wrote() -> int:
            await asyncio.wait_for(self.consumer.wait_for_replies(), 10)
            return await self.consumer.write_once()

        await wait_until(wrote, 10, "no answer went out", interval_s=0)

    async def write_notes(self) -> None:
        await asyncio.wait_for(self.consumer.wait_for_replies(), 10)
        await self.consumer.write_once()

    async def read(self) -> int:
        await self.consumer._server_clock.sync(self.consumer._redis)
        return await self.consumer.read_once(SETTINGS.block_ms * 5)

    async def read_jobs(self, count: int = 1) -> None:
        """Read until `count` jobs were taken: the front-end's send loop adds them on later turns."""
        taken = 0

        async def enough() -> bool:
            nonlocal taken
            taken += await self.read()
            return taken >= count

        await wait_until(enough, 10, f"fewer than {count} jobs read", interval_s=0)


async def wait_for_queued(redis, ready: Callable[[int], bool], what: str) -> None:
    """Wait until the number of entries in the batch tier's streams satisfies `ready`: a front-end's send loop
    adds and deletes them on its later turns."""
    async def counted() -> bool:
        return ready(sum([await redis.xlen(KEYS.jobs("batch", p)) for p in range(SETTINGS.partitions)]))

    await wait_until(counted, 10, what)


@pytest.fixture
async def redis(redis_server):
    client = make_stream_client(redis_server.url, block_ms=SETTINGS.block_ms)
    yield client
    await client.aclose()


@pytest.fixture
async def frontend(redis):
    queues = []

    def make(name: str = "f1", settings: ClusterSettings = SETTINGS) -> ClusterQueue:
        q = ClusterQueue(redis, FakeJobQueue(), keys=KEYS, settings=settings, partitions=SETTINGS.partitions,
                         server_clock=ServerClock(), metrics=Metrics(), frontend_id=name)
        q.start()
        queues.append(q)
        return q

    yield make
    for q in queues:
        await q.stop()


async def test_a_job_goes_to_the_worker_and_its_answer_comes_back(redis, frontend):
    node = Node(redis, "w1", FakeClock())
    await node.leases.renew()
    assert node.leases.owned == frozenset(range(4))
    fe = frontend()
    future = fe.submit(chat_job("hello"))
    await node.read_jobs()
    job = await next_job(node.queue)
    assert (job.caller, job.merge_key, job.request_id) == (Caller("t", "batch"), "mk-hello", "r-hello")
    answer(job, "hi there")
    await node.write()
    outcome = await asyncio.wait_for(future, 10)
    assert outcome.body["choices"][0]["message"]["content"] == "hi there"
    assert sum([await redis.xlen(KEYS.jobs("batch", p)) for p in range(4)]) == 0  # acknowledged and deleted


async def test_the_worker_counts_a_jobs_window_from_when_its_front_end_queued_it(redis, frontend):
    tiers = [t.model_copy(update={"window_ms": 2000}) if t.name == "batch" else t for t in default_tiers()]
    node = Node(redis, "w1", monotonic, tiers)  # real clocks on both sides, as in two processes
    await node.leases.renew()
    queued = chat_job("early")
    queued.enqueued_at -= 0.3  # it waited 300 ms at the front-end before the send
    frontend().submit(queued)
    await node.read_jobs()
    job = await next_job(node.queue)
    # Both ends see one clock through Redis's TIME: the worker's copy keeps the front-end's enqueue time
    # (to within the clock sync's error), so its merge window and aging do not start again at the read.
    assert abs(job.enqueued_at - queued.enqueued_at) < 0.05
    assert job.enqueued_at <= monotonic() - 0.25


async def test_a_job_that_arrives_after_its_window_would_have_closed_still_waits_for_its_backlog(redis, frontend):
    tiers = [t.model_copy(update={"window_ms": 250}) if t.name == "batch" else t for t in default_tiers()]
    node = Node(redis, "w1", monotonic, tiers)
    await node.leases.renew()
    late = chat_job("late")
    late.enqueued_at -= 2.0  # far beyond the batch tier's 250 ms window (a backlog after a handover)
    frontend().submit(late)
    await node.read_jobs()
    job = await next_job(node.queue)
    # Its window counts as if it had 50 ms left: the rest of its backlog, read a moment later, joins it.
    read_at = node.consumer._held.get(next(iter(node.consumer._held))).read_at
    assert abs(job.enqueued_at - (read_at - 0.25 + 0.05)) < 0.01


async def test_a_backlog_of_one_merge_key_comes_in_whole_so_it_merges_as_in_one_process(redis, frontend):
    node = Node(redis, "w1", FakeClock(), settings=SETTINGS.model_copy(update={"prefetch": 64}))
    await node.leases.renew()
    fe = frontend()
    for i in range(40):  # one popular prompt while its worker was busy (or its partition changed hands)
        fe.submit(chat_job(f"question {i}", merge_key="mk-popular"))
    await wait_for_queued(redis, lambda n: n >= 40, "the send loop never added the 40 jobs")
    await node.read()  # the first read takes a fair share of every stream, and sees this one is full
    await node.read()  # the next takes the rest of it in one piece (not a few per read, each merging alone)
    assert len(node.queue.jobs) == 40


async def test_an_answer_released_early_gets_the_providers_usage_at_the_front_end_when_it_arrives(redis, frontend):
    node, future, job = await read_by_a_worker(redis, frontend(), "released early")
    reported = asyncio.get_running_loop().create_future()
    FakeJobQueue().answer(job, ChatOutcome({"choices": [{"message": {"content": "early"}}]}, "sim", 0.01,
                                           batch_size=3, settled_usage=reported))
    await node.write()
    outcome = await asyncio.wait_for(future, 10)
    assert outcome.settled_usage is not None and not outcome.settled_usage.done()  # the merged call goes on
    usage = TokenUsage(40, 12, cached_tokens=8)
    reported.set_result(usage)  # the merged call ended: the provider's usage, apportioned to this member
    await node.write_notes()
    assert await asyncio.wait_for(outcome.settled_usage, 10) == usage


async def test_identical_jobs_from_two_frontends_share_one_call(redis, frontend):
    node = Node(redis, "w1", FakeClock())
    await node.leases.renew()
    first, second = frontend("f1").submit(chat_job("same")), frontend("f2").submit(chat_job("same"))
    await node.read_jobs(2)
    job = await next_job(node.queue)
    assert len(node.queue.jobs) == 1  # the second joined the first
    answer(job, "shared")
    await node.write()
    for future in (first, second):
        assert (await asyncio.wait_for(future, 10)).body["choices"][0]["message"]["content"] == "shared"


async def test_two_workers_split_partitions_and_a_zombie_stops_holding(redis):
    clock = FakeClock()
    a, b = Node(redis, "wa", clock), Node(redis, "wb", clock)
    await a.leases.renew()
    await b.leases.renew()  # b sees two live workers, takes what is free (nothing yet)
    await a.leases.renew()  # a gives up half
    await b.leases.renew()
    assert len(a.leases.owned) == len(b.leases.owned) == 2
    assert a.leases.owned.isdisjoint(b.leases.owned)
    clock.advance(SETTINGS.lease_ms / 1000)  # a cannot renew in time (paused, cut off)
    assert a.leases.owned == frozenset() and a.consumer.streams() == []
    held = sorted(a.leases._owned)
    await redis.set(KEYS.lease(held[0]), "wb")  # meanwhile b took one of them
    await a.leases.renew()  # a's late round keeps what nobody took and gives up the other
    assert a.leases.owned == frozenset(held[1:])


async def test_held_jobs_are_heartbeated_and_a_dead_workers_jobs_are_claimed(redis, frontend):
    clock = FakeClock()
    a, b = Node(redis, "wa", clock), Node(redis, "wb", clock)
    await a.leases.renew()
    future, _job = await read_by(a, frontend(), "long call")  # in progress at a, never answered: a is about to die
    stream, entry = next(iter(a.consumer._held))
    await redis.xclaim(stream, GROUP, "wa", 0, [entry], idle=SETTINGS.claim_idle_ms * 2, justid=True)
    await a.consumer.heartbeat_once()  # a is alive: its heartbeat makes the job fresh again
    await a.leases.release()
    await b.leases.renew()
    b.consumer._grouped.add(stream)
    assert await b.consumer.claim_once() == 0
    await redis.xclaim(stream, GROUP, "wa", 0, [entry], idle=SETTINGS.claim_idle_ms * 2, justid=True)  # a died
    assert await b.consumer.claim_once() == 1
    assert b.metrics.cluster_claims._value.get() == 1
    answer(await next_job(b.queue), "answered by b")
    await b.write()
    assert (await asyncio.wait_for(future, 10)).body["choices"][0]["message"]["content"] == "answered by b"


async def test_the_first_reply_wins_and_later_ones_are_dropped_and_counted(redis, frontend):
    fe = frontend()
    future = fe.submit(chat_job("twice"))
    await wait_until(lambda: len(fe._inflight), 10, "the send loop never sent it", interval_s=0)
    cid = fe._inflight.cids()[0]
    for text in ("first", "second"):
        outcome = ChatOutcome({"choices": [{"message": {"content": text}}]}, "sim", 0.0)
        await redis.xadd(KEYS.replies("f1"), encode_reply(WireReply(cid, outcome=outcome)))
    assert (await asyncio.wait_for(future, 10)).body["choices"][0]["message"]["content"] == "first"
    await wait_until(lambda: fe._metrics.cluster_duplicates_dropped._value.get() >= 1, 10,
                     "the reader never dropped the second reply")


async def test_a_job_whose_callers_all_left_is_taken_back_before_a_worker_reads_it(redis, frontend):
    fe = frontend()
    future = fe.submit(chat_job("abandoned"))
    await wait_until(fe._inflight.entries, 10, "the send loop never added it")
    stream, _entry = fe._inflight.entries()[0]
    assert await redis.xlen(stream) == 1
    future.cancel()  # what SingleFlight does when the last caller leaves
    await wait_for_queued(redis, lambda n: n == 0, "the send loop never deleted it")
    node = Node(redis, "w1", FakeClock())
    await node.leases.renew()
    assert await node.read() == 0 and node.queue.jobs == []  # no upstream call for nobody


async def test_a_worker_drops_a_held_job_whose_front_end_took_it_back_before_it_is_sent(redis, frontend):
    node, future, job = await read_by_a_worker(redis, frontend(), "waiting in a window")  # not yet sent upstream
    future.cancel()  # its every caller left: the front-end deletes the entry
    await wait_for_queued(redis, lambda n: n == 0, "the front-end never deleted the entry")
    await node.consumer.heartbeat_once()  # the heartbeat finds the entry gone
    assert job.future.cancelled() and node.consumer.held == 0
    assert node.metrics.cluster_jobs.labels("withdrawn")._value.get() == 1


async def test_an_expired_job_is_dropped_by_the_worker(redis, frontend):
    node = Node(redis, "w1", FakeClock())
    await node.leases.renew()
    fe = frontend()
    fe.submit(chat_job("too late", deadline_s=-1.0))
    await wait_until(lambda: len(fe._inflight), 10, "the send loop never sent it")
    assert await node.read() == 0
    assert node.queue.jobs == [] and node.metrics.cluster_jobs.labels("expired")._value.get() == 1


class ProbeSteps:
    """A front-end's sleep between two fallback probes, released one probe at a time by the test."""

    def __init__(self) -> None:
        self._go = asyncio.Event()
        self._parked = asyncio.Event()

    async def sleep(self, _seconds: float) -> None:
        self._parked.set()
        await self._go.wait()
        self._go.clear()

    async def parked(self) -> None:
        """Until the front-end waits for its next probe."""
        await asyncio.wait_for(self._parked.wait(), 10)

    async def probe(self, fe: ClusterQueue) -> None:
        """Let one probe of `fe` run, and wait until it is done: it waits for the next, or left its fallback."""
        self._parked.clear()
        self._go.set()
        await wait_until(lambda: self._parked.is_set() or not fe.in_fallback, 10, "the probe never ended",
                         interval_s=0)


def stepped_frontend(redis, settings: ClusterSettings = SETTINGS, clock: Clock = monotonic) -> tuple[ClusterQueue,
                                                                                                     ProbeSteps]:
    steps = ProbeSteps()
    fe = ClusterQueue(redis, FakeJobQueue(), keys=KEYS, settings=settings, partitions=SETTINGS.partitions,
                      server_clock=ServerClock(), metrics=Metrics(), frontend_id="f1", sleep=steps.sleep, clock=clock)
    fe.start()
    return fe, steps


async def test_frontend_falls_back_to_local_merging_and_hands_over_its_sent_jobs_once_redis_is_back(redis_server,
                                                                                                    redis):
    fe, steps = stepped_frontend(redis)
    try:
        waiting = fe.submit(chat_job("in flight"))
        await wait_until(lambda: fe._inflight.entries(), 10, "the send loop never sent it", interval_s=0)
        redis_server.stop()
        await steps.parked()  # its reply loop lost Redis
        assert fe.in_fallback and fe._metrics.cluster_fallback._value.get() == 1
        local: FakeJobQueue = fe._local  # type: ignore[assignment]
        fe.submit(chat_job("while down"))
        assert (await next_job(local)).request_id == "r-while down"  # new jobs are served here at once
        await steps.probe(fe)
        assert local.jobs[1:] == []  # a worker may have sent the one in flight: it waits while Redis is away
        redis_server.start()
        await steps.probe(fe)  # Redis is back, with no note from a worker: the hand-over serves it here
        moved = await next_job(local, 1)
        assert moved.request_id == "r-in flight"
        answer(moved, "local")
        assert (await waiting).body["choices"][0]["message"]["content"] == "local"
        assert not fe.in_fallback and fe._metrics.cluster_fallback._value.get() == 0
    finally:
        await fe.stop()


@dataclass
class HeldForHandOver:
    """Two jobs a front-end sent and a worker read, held by the front-end as Redis is lost (`held_for_hand_over`)."""

    fe: ClusterQueue
    steps: ProbeSteps
    node: Node
    first: asyncio.Future  # the first job's future at the front-end
    first_text: str
    by_id: dict[str, ChatJob]  # the jobs as the worker read them

    async def first_answered_by_the_worker(self) -> str:
        """The worker answers the first job and writes the answer: the content its caller got."""
        answer(self.by_id["r-" + self.first_text], "from the worker")
        await self.node.write()
        return (await asyncio.wait_for(self.first, 10)).body["choices"][0]["message"]["content"]


async def held_for_hand_over(redis, first: str, second: str) -> HeldForHandOver:
    """Jobs `first` and `second` sent by a stepped front-end and read by worker w1 (on a fake clock); then the
    front-end falls back, as its reply loop does when a read fails, holding them for a hand-over. The caller
    stops `.fe`."""
    fe, steps = stepped_frontend(redis)
    node = Node(redis, "w1", FakeClock())
    await node.leases.renew()
    first_future = fe.submit(chat_job(first))
    fe.submit(chat_job(second))
    await node.read_jobs(2)
    fe._fall_back([], "redis")
    await steps.parked()
    return HeldForHandOver(fe, steps, node, first_future, first, {job.request_id: job for job in node.queue.jobs})


async def test_a_hand_over_serves_here_only_the_jobs_no_worker_sent_and_no_worker_can_send_them_after(redis):
    held = await held_for_hand_over(redis, "marked", "unmarked")
    fe, steps, by_id = held.fe, held.steps, held.by_id
    try:
        assert await by_id["r-marked"].before_send()  # the worker sends this one upstream: marked and noted
        await steps.probe(fe)  # Redis answers: the hand-over
        local: FakeJobQueue = fe._local  # type: ignore[assignment]
        assert [job.request_id for job in local.jobs] == ["r-unmarked"]
        assert not await by_id["r-unmarked"].before_send()  # taken back: the worker can no longer send it
        assert await held.first_answered_by_the_worker() == "from the worker"
        assert [job.request_id for job in local.jobs] == ["r-unmarked"]
    finally:
        await fe.stop()


async def test_a_mark_whose_reply_was_lost_is_looked_up_so_its_job_is_neither_left_unanswered_nor_sent_twice(redis):
    # The master dies mid-mark: for one job the script ran (and its note survived on the new master), for the
    # other it never ran. The worker cannot tell from the error; what Redis holds once it answers decides.
    held = await held_for_hand_over(redis, "ran", "never ran")
    fe, steps, node, by_id = held.fe, held.steps, held.node, held.by_id
    markers = node.consumer._markers
    mark, confirm = markers.mark, markers.confirm
    handed_over, confirming = asyncio.Event(), []

    async def ran_then_lost(entries):
        await mark(entries)
        raise RedisConnectionError("the master died before its reply")

    async def never_ran(entries):
        raise RedisConnectionError("the master died first")

    async def after_the_hand_over(entries):
        confirming.append(entries)
        await handed_over.wait()  # Redis answers again: the front-end's probe and the worker race
        return await confirm(entries)

    try:
        markers.confirm = after_the_hand_over
        markers.mark = ran_then_lost
        ran = asyncio.ensure_future(by_id["r-ran"].before_send())
        await wait_until(lambda: len(confirming) == 1, 10, "the lost mark was never looked up", interval_s=0)
        markers.mark = never_ran
        not_ran = asyncio.ensure_future(by_id["r-never ran"].before_send())
        await wait_until(lambda: len(confirming) == 2, 10, "the lost mark was never looked up", interval_s=0)
        await steps.probe(fe)  # the hand-over deletes both entries and reads the one note
        local: FakeJobQueue = fe._local  # type: ignore[assignment]
        assert [job.request_id for job in local.jobs] == ["r-never ran"]  # served here, once
        await node.consumer.heartbeat_once()  # both entries gone: the marks' verdict decides, not the heartbeat
        node.clock.advance(SETTINGS.claim_idle_ms / 1000)  # Redis took a while: past the fence, by the local clock
        handed_over.set()
        assert await asyncio.wait_for(ran, 10)  # it was marked and noted: the worker sends it
        assert not await asyncio.wait_for(not_ran, 10)  # not marked: the front-end serves it, so the worker does not
        for _ in range(3):
            await asyncio.sleep(0)  # a fence due now would fire here
        assert not by_id["r-ran"].future.done() and node.consumer.held == 1  # marked: out of the fence's reach
        assert await held.first_answered_by_the_worker() == "from the worker"
        assert [job.request_id for job in local.jobs] == ["r-never ran"]
    finally:
        await fe.stop()


async def test_a_sender_missing_from_redis_is_dead_to_a_front_end_only_once_it_stays_missing_past_the_window(redis):
    # Right after a failover the new master knows no worker's connection until each registers again: a sent
    # job served locally on that first look would go upstream twice.
    clock = FakeClock()
    fe, _steps = stepped_frontend(redis, clock=clock)
    node = Node(redis, "w1", FakeClock())
    await node.leases.renew()
    try:
        fe.submit(chat_job("sent"))  # its deadline on the real clock: the worker reads it in Redis time
        await node.read_jobs(1)
        assert await node.queue.jobs[0].before_send()  # marked and noted: w1 sent it upstream
        await wait_until(lambda: fe._inflight.senders() == {"w1"}, 10, "the note never arrived", interval_s=0)
        await redis.hset(KEYS.presence, "w1", 10**9)  # registered under a connection this Redis does not have
        assert await fe._dead_senders() == set()  # missing on the first look: its jobs keep waiting for it
        clock.advance(0.4)
        assert await fe._dead_senders() == set()
        clock.advance(0.2)  # missing past the confirmation window: dead, so its jobs are served elsewhere
        assert await fe._dead_senders() == {"w1"}
    finally:
        await fe.stop()


async def test_jobs_held_while_redis_stays_away_are_served_here_once_their_wait_runs_out(redis_server, redis):
    clock = FakeClock()
    fe, steps = stepped_frontend(redis, SETTINGS.model_copy(update={"failover_wait_s": 5.0}), clock)
    try:
        waiting = fe.submit(chat_job("in flight", clock=clock))
        await wait_until(lambda: fe._inflight.entries(), 10, "the send loop never sent it", interval_s=0)
        redis_server.stop()
        await steps.parked()
        local: FakeJobQueue = fe._local  # type: ignore[assignment]
        clock.advance(4.9)
        await steps.probe(fe)
        assert local.jobs == []
        clock.advance(0.2)
        await steps.probe(fe)  # past failover_wait_s: served here rather than not at all
        moved = await next_job(local)
        answer(moved, "local")
        assert (await waiting).body["choices"][0]["message"]["content"] == "local"
    finally:
        await fe.stop()


async def test_with_no_live_worker_the_frontend_merges_locally_and_returns_when_one_renews(redis, frontend):
    # A long lease_ms on the front-end's side: the worker below renews once, and a loaded machine must not see
    # it go stale before the test ends (this Redis is fresh: no other test's worker is in it).
    fe = frontend(settings=SETTINGS.model_copy(update={"local_without_workers": True, "fallback_probe_s": 0.05,
                                                       "lease_ms": 60_000}))
    waiting = fe.submit(chat_job("nobody reads this"))
    local: FakeJobQueue = fe._local  # type: ignore[assignment]
    moved = await next_job(local)  # no worker renewed within lease_ms: the job is served here
    assert fe.in_fallback and fe._metrics.cluster_fallback._value.get() == 1
    answer(moved, "served locally")
    assert (await asyncio.wait_for(waiting, 10)).body["choices"][0]["message"]["content"] == "served locally"
    # taken back from Redis: a worker arriving later does not run it again
    await wait_for_queued(redis, lambda n: n == 0, "the job served locally was never taken back")
    node = Node(redis, "w1", FakeClock())
    await node.leases.renew()  # a worker is alive again
    await wait_until(lambda: not fe.in_fallback, 30, "the front-end never left its fallback", interval_s=0.05)
    future = fe.submit(chat_job("for the worker"))
    await node.read_jobs()
    answer(await next_job(node.queue), "from the worker")
    await node.write()
    assert (await asyncio.wait_for(future, 10)).body["choices"][0]["message"]["content"] == "from the worker"


async def test_a_frontend_in_cluster_mode_queues_on_redis_and_never_loads_the_similarity_model(
        redis_server, start_broker, simulator):
    from tests.conftest import provider_for

    config = {"providers": [provider_for(simulator)], "redis": {"url": redis_server.url}}
    frontend = await start_broker({**config, "cluster": {"enabled": True}})
    assert isinstance(frontend.broker.queue, ClusterQueue) and frontend.broker.model_host is None
    assert (await frontend.http.get("/readyz")).status == 200


async def test_an_identical_job_read_right_after_an_answer_does_not_take_that_answer_from_its_caller(redis, frontend):
    node, first, job = await read_by_a_worker(redis, frontend(), "same question")
    stream, entry = next(iter(node.consumer._held))
    held = node.consumer._held.get((stream, entry))
    answer(job, "first")  # the answer is set; the consumer hears of it only on the loop's next turn
    twin = replace(held.job, correlation_id="twin")
    node.consumer._accept(stream, b"1-1", encode_job(twin), node.clock())  # an identical job read in between: a new flight
    await node.write()
    assert (await asyncio.wait_for(first, 10)).body["choices"][0]["message"]["content"] == "first"


async def test_a_stopping_worker_gives_its_partitions_back_and_finishes_the_jobs_it_holds(redis, frontend):
    from mergebroker.broker.cluster.worker import ClusterWorker

    queue, metrics, server_clock = FakeJobQueue(), Metrics(), ServerClock()
    leases = PartitionLeases(redis, KEYS, "w1", partitions=SETTINGS.partitions, lease_ms=SETTINGS.lease_ms,
                             server_clock=server_clock)
    consumer = StreamConsumer(redis, queue, keys=KEYS, settings=SETTINGS, tiers=default_tiers(), leases=leases,
                              server_clock=server_clock, consumer_id="w1", aging_per_s=10.0, metrics=metrics)
    worker = ClusterWorker(redis, consumer, leases, keys=KEYS, settings=SETTINGS, metrics=metrics)
    worker.start()
    future = frontend().submit(chat_job("asked just before a rolling restart"))
    job = await next_job(queue)  # read by the worker's own loop, now in progress
    stopping = asyncio.ensure_future(worker.stop())
    async def given_back() -> bool:
        return not await redis.exists(*[KEYS.lease(p) for p in range(SETTINGS.partitions)])

    await wait_until(given_back, 10, "the stopping worker never gave its leases back")  # it does so first
    assert not stopping.done()  # still finishing the job it holds
    answer(job, "finished while stopping")
    assert (await asyncio.wait_for(future, 10)).body["choices"][0]["message"]["content"] == "finished while stopping"
    await asyncio.wait_for(stopping, 10)


async def test_a_streaming_job_merges_on_its_frontend_because_a_stream_cannot_cross_redis(redis, frontend):
    fe = frontend()
    job = chat_job("streamed")
    job.stream = True
    fe.submit(job)
    local: FakeJobQueue = fe._local  # type: ignore[assignment]
    assert local.jobs == [job] and fe._outbox == []
