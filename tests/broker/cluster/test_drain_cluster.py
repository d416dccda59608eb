"""A stopping worker's drain in cluster mode: at its deadline the jobs it never sent upstream go back at once
(the next owner claims them on its next scan, not after claim_idle_ms), and a job it sent stays its own, so no
job goes upstream twice. Real Redis, parts driven by hand."""

from __future__ import annotations

import asyncio

import pytest

from mergebroker.broker.cluster.partition import GROUP
from mergebroker.clock import FakeClock
from tests.broker.cluster.test_cluster_fencing import content, parts  # noqa: F401 - a fixture
from tests.broker.cluster.test_cluster_streams import Node, answer, chat_job, next_job, read_by

pytestmark = pytest.mark.redis


async def test_unsent_jobs_are_handed_back_at_the_drain_deadline_and_sent_ones_are_kept(parts):  # noqa: F811
    redis, frontend = parts
    clock = FakeClock()  # never advanced: nothing idles on its own
    a, b = Node(redis, "wa", clock), Node(redis, "wb", clock)
    await a.leases.renew()
    fe = frontend()
    unsent_future, unsent = await read_by(a, fe, "still in a merge window at the deadline")
    sent_future = fe.submit(chat_job("upstream at the deadline"))
    await a.read_jobs()
    sent = await next_job(a.queue, seen=1)
    sent.mark_sent()
    await a.write_notes()

    assert await a.consumer.hand_back() == 1
    assert unsent.future.cancelled() and not sent.future.done() and a.consumer.held == 1
    await a.leases.release()  # a stopping worker gives its partitions back first
    await b.leases.renew()
    await b.consumer._ensure_groups(b.consumer.streams())
    assert await b.consumer.claim_once() == 1  # at once: no claim_idle_ms to wait out
    [taken] = b.queue.jobs
    assert taken.request_id == unsent.request_id
    answer(await next_job(b.queue), "answered by b")
    await b.write()
    assert content(await asyncio.wait_for(unsent_future, 10)) == "answered by b"

    owners = {p["consumer"] for s in b.consumer.streams() for p in await redis.xpending_range(s, GROUP, "-", "+", 10)}
    assert owners == {b"wa"}  # the sent job's entry: still a's, not claimable by idle (its marker)
    assert not sent_future.done()
