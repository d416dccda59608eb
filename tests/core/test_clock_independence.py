"""A scenario driven by a FakeClock behaves the same wherever that clock starts: far below the real
monotonic clock and far above it.

A test that mixes the real clock into a FakeClock scenario (a deadline read from the real clock on a job
that a fake-clocked dispatcher runs) passes on a machine up long enough and fails on a freshly booted one,
or the other way round. Here each representative scenario (merge windows and callers' deadlines, the
similarity budget, upstream rate limits) runs at both ends on every machine, so such a mix fails at once.
"""

from __future__ import annotations

import asyncio

import pytest

from mergebroker.clock import FakeClock
from mergebroker.providers.pacing import UpstreamLimiter
from mergebroker.providers.simulator.server import answer_for
from tests.broker.engine.chat.test_dispatch import budget_from_first_arrival
from tests.broker.engine.limits.test_tiers_api import SubmitSpy
from tests.broker.http.test_request_path import WINDOW, config
from tests.providers.test_upstream_limiter import Recorder, settle

STARTS = {"below_the_real_clock": 1.0, "above_the_real_clock": 1e9}


@pytest.fixture(params=list(STARTS.values()), ids=list(STARTS))
def clock(request: pytest.FixtureRequest) -> FakeClock:
    return FakeClock(request.param)


async def test_a_callers_deadline_and_its_merge_window_fall_due_on_the_brokers_clock(simulator, start_broker,
                                                                                     clock: FakeClock):
    broker = await start_broker(config(simulator, [{"name": "slow", **WINDOW}]), clock=clock)  # a 5 s window
    spy = SubmitSpy(broker)
    impatient = asyncio.create_task(broker.chat("an impatient question", broker={"timeout_s": 0.2}))
    patient = asyncio.create_task(broker.chat("a patient question"))
    await spy.wait_for(2)
    clock.advance(0.2)
    status, body, _ = await asyncio.wait_for(impatient, 10)
    assert status == 504 and body["error"]["code"] == "deadline_exceeded"
    assert not patient.done()  # its window is still open
    clock.advance(4.8)
    status, body, _ = await asyncio.wait_for(patient, 10)
    assert status == 200 and body["choices"][0]["message"]["content"] == answer_for("a patient question")


async def test_the_similarity_budget_counts_from_the_groups_first_arrival(simulator, clock: FakeClock):
    assert await budget_from_first_arrival(simulator, clock) == ([1, 1], 2, 2)


async def test_the_upstream_limiter_lets_calls_out_at_its_token_rate(clock: FakeClock):
    limiter = UpstreamLimiter(rpm=600, tpm=6000, clock=clock)  # 10 calls and 100 tokens per second
    recorder = Recorder(limiter)
    for i in range(20):
        await recorder.start(f"c{i}", tokens=25)
    served = []
    for _ in range(4):
        served.append(len(recorder.served))
        clock.advance(1)
        await settle()
    assert served == [4, 8, 12, 16]  # a burst of one second's tokens, then 100 tokens a second
    await recorder.stop()
