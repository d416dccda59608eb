"""The GC policy: start-up objects frozen, full passes paused while large bulk work is held and run once
when it ends, so a big job's objects are never walked by a pass on the event loop while it runs."""

from __future__ import annotations

import asyncio
import gc
import weakref

from mergebroker.broker.engine.ground.config import load_settings
from mergebroker.gc_policy import PAUSED, YOUNG_THRESHOLD, GcPolicy, let_go
from tests.broker.bulk.test_batch_runner import create_batch, service_on


async def test_a_large_list_is_let_go_a_slice_per_loop_turn():
    class Line:
        pass

    lines = [Line() for _ in range(12)]
    alive = [weakref.ref(x) for x in lines]
    letting_go = asyncio.ensure_future(let_go(lines, step=5))
    await asyncio.sleep(0)  # one turn: the first slice only
    assert len(lines) == 7 and [r() is None for r in alive] == [False] * 7 + [True] * 5
    await letting_go
    assert lines == [] and all(r() is None for r in alive)


class FakeCollector:
    """Records what the policy asks of the collector; `collected` is set by each full pass."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.threshold = (700, 10, 10)
        self.collected = asyncio.Event()

    def collect(self, generation: int = 2) -> int:
        self.calls.append(("collect", generation))
        self.collected.set()
        return 0

    def freeze(self) -> None:
        self.calls.append(("freeze",))

    def set_threshold(self, *threshold: int) -> None:
        self.calls.append(("set_threshold", *threshold))
        self.threshold = threshold


def test_start_up_collects_then_freezes_what_lives_and_raises_the_young_threshold():
    collector = FakeCollector()
    GcPolicy(collector, young=(5000, 10), full=10).start_up()
    assert collector.calls == [("collect", 2), ("freeze",), ("set_threshold", 5000, 10, 10)]


def test_full_passes_pause_while_the_weight_held_reaches_pause_from_and_one_runs_when_it_falls_back():
    collector = FakeCollector()
    policy = GcPolicy(collector, young=(5000, 10), full=10, held_young=(5000, 2), pause_from=10_000)
    small = policy.hold(4_000)
    assert collector.calls == [] and not policy.paused  # small work: the collector as it was
    large = policy.hold(6_000)
    assert collector.threshold == (5000, 2, PAUSED) and ("collect", 2) not in collector.calls
    small.release()
    small.release()  # twice is once
    assert collector.threshold == (5000, 10, 10) and collector.calls[-1] == ("collect", 2)
    assert policy.held == 6_000
    large.release()
    assert policy.held == 0 and collector.calls.count(("collect", 2)) == 1  # no pause, nothing held back


def test_a_cycle_that_dies_old_during_a_hold_waits_for_its_end_and_is_freed_by_it():
    class Node:
        pass

    saved = gc.get_threshold()
    policy = GcPolicy(gc, young=saved[:2], full=saved[2], held_young=saved[:2], pause_from=1)
    try:
        with policy.hold(1):
            assert gc.get_threshold()[2] == PAUSED
            node = Node()
            node.me = node  # a cycle: only a pass frees it
            alive = weakref.ref(node)
            gc.collect(1)  # survives the young passes: now in the oldest generation
            del node
            gc.collect(1)
            assert alive() is not None  # young passes never walk the oldest generation
        assert alive() is None and gc.get_threshold() == saved
    finally:
        gc.set_threshold(*saved)


def test_the_objects_of_64_requests_in_flight_make_no_young_pass_under_the_default_policy():
    # A passthrough request holds ~233 tracked objects while in flight (measured at 64 in flight), all freed by
    # reference counting: a young pass over them finds nothing and only moves them on for later passes.
    per_request, in_flight = 233, 64
    saved = gc.get_threshold()
    passes: list[int] = []

    def seen(phase: str, info: dict) -> None:
        if phase == "start":
            passes.append(info["generation"])

    policy = GcPolicy(gc, pause_from=1)
    try:
        policy.hold(1).release()  # the policy's own thresholds, then one full pass: the young count starts at 0
        assert gc.get_threshold()[0] == YOUNG_THRESHOLD
        gc.callbacks.append(seen)
        held = [{"request": i} for i in range(per_request * in_flight)]
        gc.callbacks.remove(seen)
        assert passes == [] and len(held) == per_request * in_flight
    finally:
        if seen in gc.callbacks:
            gc.callbacks.remove(seen)
        gc.set_threshold(*saved)


async def test_a_running_batch_holds_its_lines_until_it_has_ended(simulator, tmp_path):
    simulator.set_faults(latency_base_ms=20)
    collector = FakeCollector()
    policy = GcPolicy(collector, pause_from=6)
    settings = load_settings(None, environ={}, overrides={"batches": {"dir": str(tmp_path), "concurrency": 1},
                                                          "merge": {"embedder": "none"}})
    service, pools = service_on(simulator, settings, gc_policy=policy)
    await service.start()
    try:
        batch = await create_batch(service, 6)
        await service.wait_until(batch["id"], lambda d: d["request_counts"]["completed"] >= 1)
        assert policy.held == 6 and collector.threshold[2] == PAUSED  # its lines are alive: no full pass
        done = await service.wait_until(batch["id"], lambda d: d["status"] == "completed")
        await asyncio.wait_for(collector.collected.wait(), 10)  # the batch's task ended: the held-back pass
        assert done["request_counts"]["completed"] == 6
        assert policy.held == 0 and not policy.paused and collector.threshold[2] != PAUSED
    finally:
        await service.stop()
        await pools.close()
