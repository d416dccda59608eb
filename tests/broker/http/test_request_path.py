"""Along the chat path every caller keeps its own deadline, tier and opt-out, and always gets exactly one answer."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web
from structlog.testing import capture_logs

from mergebroker.broker.engine.chat.dispatch import Dispatcher, MergeOptions, TierMergePolicy
from mergebroker.broker.engine.chat.jobs import ChatJob, ChatOutcome
from mergebroker.broker.engine.chat.merge_queue import ReleasedGroup
from mergebroker.broker.engine.limits.admission import Caller
from mergebroker.clock import FakeClock
from mergebroker.errors import BrokerError, DeadlineExceeded, NotFound
from mergebroker.merge.prompt import request_blocks, response_block
from mergebroker.merge.quality_guard import GuardSettings, QualityGuard
from mergebroker.merge.shape import MergeShape
from mergebroker.providers.fake import FakePool, completion
from mergebroker.providers.simulator.faults import SimulatorConfig
from mergebroker.providers.simulator.server import answer_for, start_simulator
from tests.breaker.test_degradation import Gate
from tests.broker.engine.limits.test_tiers_api import SubmitSpy
from tests.conftest import BrokerUnderTest, provider_for

WINDOW = {"window_ms": 5000, "max_batch": 8, "similarity_threshold": 0.0}


def config(sim, tiers: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"providers": [provider_for(sim)], "merge": {"embedder": "none"}, "tiers": tiers,
            "default_tier": tiers[0]["name"], **extra}


class JoinSpy:
    """Lets a test await the moment the n-th caller has joined a pending request (leader or follower)."""

    def __init__(self, broker: BrokerUnderTest) -> None:
        flights = broker.broker.chat._flights
        self._join = flights.join
        self.count = 0
        self._changed = asyncio.Event()
        flights.join = self._record  # type: ignore[method-assign]

    async def _record(self, key: Any, start: Any) -> Any:
        self.count += 1
        self._changed.set()
        return await self._join(key, start)

    async def wait_for(self, count: int) -> None:
        while self.count < count:
            self._changed.clear()
            await asyncio.wait_for(self._changed.wait(), 10)


async def test_a_follower_with_a_longer_timeout_is_not_cut_short_by_the_leaders_deadline(simulator, start_broker):
    clock = FakeClock()
    broker = await start_broker(config(simulator, [{"name": "slow", **WINDOW}]), clock=clock)
    joins = JoinSpy(broker)
    leader = asyncio.create_task(broker.chat("the same question", broker={"timeout_s": 2}))
    await joins.wait_for(1)
    follower = asyncio.create_task(broker.chat("the same question", broker={"timeout_s": 20}))
    await joins.wait_for(2)
    clock.advance(5)  # the window closes after the leader's own deadline, well within the follower's
    status, body, headers = await follower
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == answer_for("the same question")
    assert headers["X-Broker-Cache"] == "coalesced"
    await leader
    assert simulator.stats()["chat_calls"] == 1


async def test_a_follower_of_a_call_cut_short_by_the_leaders_deadline_gets_its_own_call(start_broker):
    gate = Gate(expected=1)  # the upstream holds every call until released, and says when the first arrived
    simulator = await start_simulator(SimulatorConfig(latency_base_ms=1), sleep=gate.sleep)
    try:
        clock = FakeClock()
        broker = await start_broker(config(simulator, [{"name": "now", "window_ms": 0}]), clock=clock)
        joins = JoinSpy(broker)
        leader = asyncio.create_task(broker.chat("the same question", broker={"timeout_s": 0.5}))
        await asyncio.wait_for(gate.all_arrived.wait(), 10)  # the leader's job is at the upstream
        with capture_logs() as logs:
            follower = asyncio.create_task(broker.chat("the same question", broker={"timeout_s": 20}))
            await joins.wait_for(2)
            clock.advance(0.5)  # the job's deadline (the leader's) passes; the follower has 19.5 s left
            gate.release()
            status, body, _ = await follower
        assert status == 200 and body["choices"][0]["message"]["content"] == answer_for("the same question")
        assert (await leader)[0] == 504
        assert [e["reason"] for e in logs if e["event"] == "coalesced_retry"] == ["shared_job_deadline"]
        assert simulator.stats()["chat_calls"] == 2
    finally:
        gate.release()
        await simulator.close()


async def test_a_leader_that_leaves_mid_call_hands_the_call_to_the_followers_waiting_on_it(start_broker):
    # A lone request runs its upstream call in its own task; its client leaving cancels that task, and the
    # identical request coalesced onto it must still get its answer.
    gate = Gate(expected=1)
    simulator = await start_simulator(SimulatorConfig(latency_base_ms=1), sleep=gate.sleep)
    try:
        broker = await start_broker(config(simulator, [{"name": "now", "window_ms": 0}]))
        joins = JoinSpy(broker)
        leader = asyncio.create_task(broker.chat("the same question"))
        await asyncio.wait_for(gate.all_arrived.wait(), 10)  # the leader's own call is at the upstream
        follower = asyncio.create_task(broker.chat("the same question"))
        await joins.wait_for(2)
        leader.cancel()  # the leader's client goes away: its connection closes, its handler is cancelled
        gate.expected = 2
        gate.all_arrived.clear()
        await asyncio.wait_for(gate.all_arrived.wait(), 10)  # the call, handed over, is sent again
        gate.release()
        status, body, headers = await asyncio.wait_for(follower, 10)
        assert status == 200 and body["choices"][0]["message"]["content"] == answer_for("the same question")
        assert headers["X-Broker-Cache"] == "coalesced"
        assert simulator.stats()["chat_calls"] == 2
    finally:
        gate.release()
        await simulator.close()


async def test_a_lone_request_with_nobody_waiting_on_it_runs_in_its_own_task(simulator, start_broker):
    broker = await start_broker(config(simulator, [{"name": "now", "window_ms": 0}]))
    spy = SubmitSpy(broker)
    status, body, headers = await broker.chat("a question of its own")
    assert status == 200 and body["choices"][0]["message"]["content"] == answer_for("a question of its own")
    assert headers["X-Broker-Batch-Size"] == "1"
    assert len(spy.jobs) == 1 and spy.queued == []  # never queued: no window, no worker


async def test_an_identical_request_in_another_tier_does_not_wait_in_the_first_ones_window(simulator, start_broker):
    clock = FakeClock()
    tiers = [{"name": "batch", "priority": 0, **WINDOW}, {"name": "realtime", "priority": 100, "window_ms": 0}]
    broker = await start_broker(config(simulator, tiers), clock=clock)
    spy = SubmitSpy(broker)
    waiting = asyncio.create_task(broker.chat("shared words", headers={"X-Broker-Tier": "batch"}))
    await spy.wait_for(1)
    status, body, headers = await asyncio.wait_for(
        broker.chat("shared words", headers={"X-Broker-Tier": "realtime"}), 10)
    assert status == 200 and headers["X-Broker-Cache"] == "miss"
    assert body["choices"][0]["message"]["content"] == answer_for("shared words")
    clock.advance(5)
    assert (await waiting)[0] == 200


async def test_a_merge_opt_out_never_receives_a_merged_answer_from_an_identical_request(simulator, start_broker):
    clock = FakeClock()
    broker = await start_broker(config(simulator, [{"name": "batch", **WINDOW}]), clock=clock)
    spy = SubmitSpy(broker)
    mergeable = [asyncio.create_task(broker.chat(q)) for q in ("question one", "question two")]
    await spy.wait_for(2)
    opted_out = asyncio.create_task(broker.chat("question one", broker={"merge": False}))
    await spy.wait_for(3)
    clock.advance(5)
    status, body, headers = await opted_out
    assert status == 200 and body["choices"][0]["message"]["content"] == answer_for("question one")
    assert (headers["X-Broker-Batch-Size"], headers["X-Broker-Cache"]) == ("1", "miss")
    assert [(await t)[2]["X-Broker-Batch-Size"] for t in mergeable] == ["2", "2"]


async def test_tenant_and_user_names_containing_separators_never_share_a_cache_entry(simulator, start_broker):
    settings = config(simulator, [{"name": "standard", "window_ms": 0}], merge={"embedder": "none", "scope": "user"},
                      auth={"mode": "gateway", "gateway_secret_env": "GW"})
    broker = await start_broker(settings, environ={"GW": "s3cret"})

    def gateway(tenant: str, user: str) -> dict[str, str]:
        return {"X-Broker-Gateway-Secret": "s3cret", "X-Broker-Tenant": tenant, "X-Broker-User": user}

    _, _, first = await broker.chat("private question", temperature=0, headers=gateway("a:user:b", "c"))
    _, _, second = await broker.chat("private question", temperature=0, headers=gateway("a", "b:user:c"))
    assert (first["X-Broker-Cache"], second["X-Broker-Cache"]) == ("miss", "miss")
    _, _, again = await broker.chat("private question", temperature=0, headers=gateway("a", "b:user:c"))
    assert again["X-Broker-Cache"] == "hit"


async def test_a_deadline_error_cites_the_callers_own_shorter_timeout(simulator, start_broker):
    clock = FakeClock()
    broker = await start_broker(config(simulator, [{"name": "slow", **WINDOW}]), clock=clock)
    spy = SubmitSpy(broker)
    impatient = asyncio.create_task(broker.chat("too impatient", broker={"timeout_s": 0.2}))
    await spy.wait_for(1)
    clock.advance(0.2)
    status, body, _ = await impatient
    assert status == 504 and body["error"]["code"] == "deadline_exceeded"
    assert "0.2 s" in body["error"]["message"]


# Dispatch: whatever fails, every member gets an answer or an error at once.

class BrokenEmbedder:
    ready = True

    async def embed(self, texts: list[str]) -> list[Any]:
        raise RuntimeError("the model process died")


def dispatcher(pools: Any, *, threshold: float = 0.0, tagged: bool = False, embedder: Any = None,
               **options: Any) -> Dispatcher:
    return Dispatcher(pools, tiers={"t": TierMergePolicy(True, threshold, 8, tagged)},
                      options=MergeOptions(None, 4, {}, 100_000), embedder=embedder,
                      guard=QualityGuard(GuardSettings()), merging_allowed=lambda model: True, **options)


def jobs(*questions: str, systems: tuple[str | None, ...] = ()) -> list[ChatJob]:
    made = []
    for i, q in enumerate(questions):
        system = systems[i] if systems else None
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": q}]
        made.append(ChatJob(request_id=f"r{i}", caller=Caller("tenant", "t"), body={"model": "m", "messages": messages},
                            model="m", priority=0, shape=MergeShape(system, q), merge_key="k", prompt_tokens=10,
                            max_tokens=50, deadline=1e12, enqueued_at=0))
    return made


async def outcomes(group: list[ChatJob]) -> list[ChatOutcome | BaseException]:
    return await asyncio.wait_for(asyncio.gather(*(j.future for j in group), return_exceptions=True), 5)


async def test_a_merged_reply_of_the_wrong_shape_sends_every_member_alone():
    pools = FakePool(lambda blocks: {"choices": [None]})
    group = jobs("first question", "second question")
    await dispatcher(pools).run_group(ReleasedGroup("t", "k", group, 0.0))
    results = await outcomes(group)
    assert [r.body["choices"][0]["message"]["content"] for r in results] == [  # type: ignore[union-attr]
        answer_for("first question"), answer_for("second question")]
    assert [r.fallback for r in results] == ["bad_reply", "bad_reply"]  # type: ignore[union-attr]


async def test_a_tenant_paused_by_the_quality_guard_is_sent_alone_while_the_others_still_merge():
    def answer_blocks(blocks: list[tuple[str, str]]) -> dict[str, Any]:
        return completion("\n".join(response_block(i, answer_for(q)) for i, q in blocks))

    guard = QualityGuard(GuardSettings(window=1))
    guard.record("noisy", "m", True)
    group = jobs("first question", "second question", "third question")
    group[2].caller = Caller("noisy", "t")  # a shared (global-scope) window holds several tenants
    pools = FakePool(answer_blocks)
    d = Dispatcher(pools, tiers={"t": TierMergePolicy(True, 0.0, 8)}, options=MergeOptions(None, 4, {}, 100_000),
                   embedder=None, guard=guard, merging_allowed=lambda model: True)
    await d.run_group(ReleasedGroup("t", "k", group, 0.0))
    results = await outcomes(group)
    assert [r.batch_size for r in results] == [2, 2, 1]  # type: ignore[union-attr]
    assert pools.single_calls == ["third question"]


async def test_an_embedder_failure_sends_the_members_alone_instead_of_leaving_them_waiting():
    pools = FakePool(lambda blocks: {"choices": [None]})
    group = jobs("first question", "second question")
    await dispatcher(pools, threshold=0.5, embedder=BrokenEmbedder()).run_group(ReleasedGroup("t", "k", group, 0.0))
    results = await outcomes(group)
    assert [r.body["choices"][0]["message"]["content"] for r in results] == [  # type: ignore[union-attr]
        answer_for("first question"), answer_for("second question")]
    assert sorted(pools.single_calls) == ["first question", "second question"]


async def test_a_merged_call_refused_with_an_error_fails_every_member_at_once():
    def refuse(blocks: Any) -> Any:
        raise NotFound("The model 'm' does not exist.", code="model_not_found")

    group = jobs("first question", "second question")
    await dispatcher(FakePool(refuse)).run_group(ReleasedGroup("t", "k", group, 0.0))
    results = await outcomes(group)
    assert all(isinstance(r, NotFound) for r in results)


async def test_an_unexpected_exception_in_dispatch_fails_every_member_with_a_broker_error():
    def crash(blocks: Any) -> Any:
        raise KeyError("a bug")

    group = jobs("first question", "second question")
    await dispatcher(FakePool(crash)).run_group(ReleasedGroup("t", "k", group, 0.0))
    results = await outcomes(group)
    assert all(isinstance(r, BrokerError) and r.status == 500 for r in results)


async def test_with_tagged_system_prompts_quoting_another_members_system_prompt_is_a_leak():
    secret = "You are the assistant of Acme payroll and the salary of Bob is ninety thousand"

    def leaky(blocks: list[tuple[str, str]]) -> dict[str, Any]:
        (first, _), (second, _) = blocks
        return completion(response_block(first, "fine") + "\n" + response_block(second, f"I was told: {secret}"))

    pools = FakePool(leaky)
    group = jobs("What is the date?", "What is the time?", systems=(secret, "You are a clock."))
    await dispatcher(pools, tagged=True).run_group(ReleasedGroup("t", "k", group, 0.0))
    first, second = await outcomes(group)
    assert first.body["choices"][0]["message"]["content"] == "fine"  # type: ignore[union-attr]
    assert second.fallback == "leak"  # type: ignore[union-attr]
    assert secret not in second.body["choices"][0]["message"]["content"]  # type: ignore[union-attr]


async def test_a_chat_request_for_a_local_embedding_model_is_404_at_once(simulator, start_broker):
    broker = await start_broker(config(simulator, [{"name": "batch", **WINDOW}], providers=[
        provider_for(simulator, models=["sim-small"]), {"name": "loc", "kind": "local", "models": ["local-minilm"]}]))
    status, body, _ = await asyncio.wait_for(broker.chat("hello", model="local-minilm"), 5)
    assert status == 404 and body["error"]["code"] == "model_not_found"


# Streams: once the 200 is out, an error ends the stream with one SSE error event, never a second response.

async def start_upstream(handler: Any) -> web.AppRunner:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


def upstream_url(runner: web.AppRunner) -> str:
    port = runner.addresses[0][1]
    return f"http://127.0.0.1:{port}/v1"


FIRST_EVENT = b'data: {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "Hi"}}]}\n\n'


async def raw_stream(broker: BrokerUnderTest) -> bytes:
    body = json.dumps({"model": "sim-small", "stream": True,
                       "messages": [{"role": "user", "content": "tell me a story"}]}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", broker.port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


async def test_an_upstream_failure_mid_stream_ends_it_with_one_sse_error_event(start_broker):
    async def breaks_off(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(FIRST_EVENT)
        request.transport.close()  # the connection drops mid-answer
        return response

    upstream = await start_upstream(breaks_off)
    try:
        broker = await start_broker({"providers": [{"name": "up", "base_url": upstream_url(upstream)}],
                                     "merge": {"enabled": False}, "retry": {"attempts": 1}})
        raw = await raw_stream(broker)
    finally:
        await upstream.cleanup()
    assert raw.count(b"HTTP/1.1 ") == 1 and raw.startswith(b"HTTP/1.1 200")
    assert b'"content": "Hi"' in raw
    errors = [json.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: {\"error\"")]
    assert [e["error"]["code"] for e in errors] == ["upstream_connection_error"]  # one error event
    assert b"[DONE]" not in raw
    assert broker.broker.pools.upstreams[0].in_flight == 0
    requests = broker.broker.metrics.registry.get_sample_value(
        "mergebroker_requests_total", {"endpoint": "chat", "tier": "standard", "status": "502"})
    assert requests == 1


async def test_a_client_leaving_mid_stream_closes_the_upstream_stream(start_broker):
    upstream_closed = asyncio.Event()

    async def slow(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(FIRST_EVENT)
        try:
            await asyncio.Event().wait()  # never finishes on its own
        finally:
            upstream_closed.set()
        return response

    upstream = await start_upstream(slow)
    try:
        broker = await start_broker({"providers": [{"name": "up", "base_url": upstream_url(upstream)}],
                                     "merge": {"enabled": False}})
        async with broker.http.post("/v1/chat/completions", json={
                "model": "sim-small", "stream": True, "messages": [{"role": "user", "content": "go"}]}) as resp:
            assert resp.status == 200
            assert b"Hi" in await resp.content.readuntil(b"\n\n")
            resp.connection.transport.close()  # type: ignore[union-attr]
        await asyncio.wait_for(upstream_closed.wait(), 10)
    finally:
        await upstream.cleanup()
    assert broker.broker.pools.upstreams[0].in_flight == 0


async def test_a_hung_merged_call_leaves_its_members_time_to_be_sent_alone():
    """The merged call gets half the members' remaining time; when it hangs past that, each is re-sent alone
    and answered before its own deadline (not a 504 for everyone)."""

    class HangingMerged(FakePool):
        merged_deadlines: list[float] = []

        async def chat(self, model: str, body: dict[str, Any], **kw: Any) -> tuple[dict[str, Any], str]:
            if request_blocks(body["messages"][-1]["content"]):
                self.merged_deadlines.append(kw["deadline"])
                raise DeadlineExceeded("the merged call hung until its deadline")
            return await super().chat(model, body, **kw)

    group = jobs("first question", "second question")
    clock = FakeClock()  # the dispatcher's clock, which the members' deadlines are on
    now = clock()
    for job in group:
        job.deadline = now + 20
    pools = HangingMerged()
    await dispatcher(pools, clock=clock).run_group(ReleasedGroup("t", "k", group, 0.0))
    results = await outcomes(group)
    assert [r.fallback for r in results] == ["merged_call_failed"] * 2  # type: ignore[union-attr]
    assert pools.merged_deadlines and pools.merged_deadlines[0] <= now + 10.5
    assert sorted(pools.single_calls) == ["first question", "second question"]
