"""The local model is shared fairly: a small call goes before queued large ones, a call whose caller left never
runs, and one request's input is bounded (count and tokens, 400 above)."""

from __future__ import annotations

import concurrent.futures
import threading

from mergebroker.providers.local.model import ModelQueue
from tests.conftest import NO_MERGE_MODEL, provider_for


def test_a_small_call_runs_before_queued_large_ones_and_a_cancelled_one_never_runs():
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    queue = ModelQueue(executor)
    gate, order = threading.Event(), []

    def call(name: str) -> str:
        if name == "running":
            gate.wait(5)
        order.append(name)
        return name

    running = queue.submit(64, call, "running")
    large = [queue.submit(64, call, f"large-{i}") for i in range(3)]
    abandoned = queue.submit(64, call, "abandoned")
    unwanted = queue.submit(64, call, "unwanted", wanted=lambda: False)  # every caller left while it waited
    small = queue.submit(1, call, "small")
    assert abandoned.cancel()  # its caller left (deadline, disconnect) before the model got to it
    gate.set()
    assert [f.result(5) for f in (running, small, *large)] == ["running", "small", "large-0", "large-1", "large-2"]
    assert order == ["running", "small", "large-0", "large-1", "large-2"]
    concurrent.futures.wait([unwanted], timeout=5)
    assert unwanted.cancelled() and "unwanted" not in order
    executor.shutdown()


async def test_an_embeddings_request_over_the_input_limits_gets_400(simulator, start_broker):
    broker = await start_broker({"providers": [provider_for(simulator)], **NO_MERGE_MODEL,
                                 "embeddings": {"max_inputs": 3, "max_input_tokens": 50}})
    for inputs, code in [(["a", "b", "c", "d"], "too_many_inputs"), (["word " * 200], "too_many_tokens")]:
        async with broker.http.post("/v1/embeddings", json={"model": "sim-embed", "input": inputs}) as resp:
            body = await resp.json()
        assert resp.status == 400 and body["error"]["code"] == code and body["error"]["param"] == "input"
    async with broker.http.post("/v1/embeddings", json={"model": "sim-embed", "input": ["a", "b"]}) as resp:
        assert resp.status == 200
