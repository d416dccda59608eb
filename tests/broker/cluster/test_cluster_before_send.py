"""A cluster worker writes a job's sent marker before the upstream call, and a job whose marker cannot be
written (another worker took its entry over) never goes upstream. Real Redis, a real upstream on loopback
that looks in Redis as each call arrives, the engine's own dispatcher."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web

from mergebroker.broker.cluster.partition import GROUP
from mergebroker.broker.engine.chat.dispatch import (
    Dispatcher,
    MergeOptions,
    TierMergePolicy,
)
from mergebroker.broker.engine.chat.merge_queue import ReleasedGroup
from mergebroker.clock import FakeClock
from mergebroker.merge.quality_guard import GuardSettings, QualityGuard
from mergebroker.providers.openai.compat import (
    HttpProviderSettings,
    OpenAICompatProvider,
)
from mergebroker.providers.pool import ProviderPools
from mergebroker.providers.upstream import Upstream
from tests.broker.cluster.test_cluster_fencing import content, parts  # noqa: F401 - `parts` is a fixture
from tests.broker.cluster.test_cluster_streams import KEYS, Node, chat_job, read_by

pytestmark = pytest.mark.redis


class MarkerCheckingUpstream:
    """An OpenAI-style upstream on a loopback port that records, as each call arrives, the sent markers
    Redis holds at that moment."""

    def __init__(self, redis: Any) -> None:
        self.redis = redis
        self.markers_seen: list[dict[bytes, bytes]] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}/v1"

    async def _chat(self, request: web.Request) -> web.Response:
        keys = await self.redis.keys(f"{KEYS.prefix}:sent:*")
        self.markers_seen.append({k: await self.redis.get(k) for k in keys})
        body = await request.json()
        return web.json_response({
            "id": "c1", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "answered upstream"}}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}})


@pytest.fixture
async def upstream(parts, fake_clock: FakeClock):  # noqa: F811 - the fixture imported above
    """The upstream and a dispatcher on the test's fake clock: the one the worker's jobs have their deadlines on."""
    redis, _frontend = parts
    up = MarkerCheckingUpstream(redis)
    await up.start()
    pools = ProviderPools([Upstream(OpenAICompatProvider(HttpProviderSettings("up", up.url)))], clock=fake_clock)
    dispatcher = Dispatcher(pools, tiers={"batch": TierMergePolicy(True, 0.0, 8, False)},
                            options=MergeOptions(None, 4, {}, 100_000), embedder=None,
                            guard=QualityGuard(GuardSettings()), merging_allowed=lambda model: True, clock=fake_clock)
    yield up, dispatcher
    await pools.close()
    assert up.runner is not None
    await up.runner.cleanup()


async def held_by_a(parts, text: str, clock: FakeClock) -> tuple[Node, asyncio.Future, Any, str, bytes]:  # noqa: F811
    """Worker `wa` on `clock` holding every partition, the front-end's future of a job, the job as `wa` read it,
    its entry."""
    redis, frontend = parts
    node = Node(redis, "wa", clock)
    await node.leases.renew()
    future, job = await read_by(node, frontend(), text)
    stream, entry = next(iter(node.consumer._held))
    return node, future, job, stream, entry


async def test_the_sent_marker_is_in_redis_before_the_upstream_sees_the_call(parts, upstream, fake_clock):  # noqa: F811
    up, dispatcher = upstream
    node, future, job, stream, entry = await held_by_a(parts, "marked first", fake_clock)
    await dispatcher.run_group(ReleasedGroup("batch", job.merge_key, [job], 0.0))
    assert up.markers_seen == [{KEYS.sent(stream, entry).encode(): b"wa"}]  # there when the call arrived
    await node.write()
    assert content(await asyncio.wait_for(future, 10)) == "answered upstream"


async def test_a_job_whose_entry_another_worker_took_is_not_sent_upstream(parts, upstream, fake_clock):  # noqa: F811
    redis, _frontend = parts
    up, dispatcher = upstream
    node, _future, job, stream, entry = await held_by_a(parts, "taken over before dispatch", fake_clock)
    await redis.xclaim(stream, GROUP, "wb", 0, [entry], justid=True)  # b claimed it; a has not heartbeated since
    await dispatcher.run_group(ReleasedGroup("batch", job.merge_key, [job], 0.0))
    assert up.markers_seen == []  # never sent
    assert job.future.cancelled() and not job.dispatched and node.consumer.held == 0
    assert await redis.exists(KEYS.sent(stream, entry)) == 0  # and b may still run it
    assert (await redis.xpending_range(stream, GROUP, "-", "+", 10))[0]["consumer"] == b"wb"
    assert node.metrics.cluster_jobs.labels("taken_over")._value.get() == 1


async def test_a_member_its_hook_keeps_back_leaves_the_group_and_the_rest_is_sent(upstream, fake_clock):
    up, dispatcher = upstream
    kept, sent = chat_job("kept back", clock=fake_clock), chat_job("sent alone", clock=fake_clock)
    asked: list[str] = []

    async def refuse() -> bool:
        asked.append(kept.request_id)
        return False

    kept.before_send = refuse
    await dispatcher.run_group(ReleasedGroup("batch", None, [kept, sent], 0.0))
    assert asked == [kept.request_id] and kept.future.cancelled() and not kept.dispatched
    assert len(up.markers_seen) == 1 and content(sent.future.result()) == "answered upstream"  # one call, alone
