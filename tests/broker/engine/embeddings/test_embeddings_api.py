"""/v1/embeddings through the broker: coalescing, partial hits, order, Redis, deadlines, limits and cache scope."""

from __future__ import annotations

import asyncio
import base64
import hashlib

import numpy as np

from mergebroker.clock import FakeClock
from mergebroker.providers.simulator.faults import SimulatorConfig
from mergebroker.providers.simulator.server import start_simulator
from tests.breaker.test_degradation import eventually
from tests.conftest import provider_for


def emb_config(sim, **extra) -> dict:
    return {"providers": [provider_for(sim, models=["sim-embed"])], "merge": {"enabled": False},
            "embeddings": {"window_ms": 5}, **extra}


async def embed(running, inputs, headers=None, **extra):
    async with running.http.post("/v1/embeddings", json={"model": "sim-embed", "input": inputs, **extra},
                                headers=headers or {}) as resp:
        return resp.status, await resp.json(), resp.headers


async def test_fifty_concurrent_identical_requests_send_one_text_upstream(simulator, start_broker):
    broker = await start_broker(emb_config(simulator))
    results = await asyncio.gather(*(embed(broker, "the same text") for _ in range(50)))
    assert all(status == 200 for status, _, _ in results)
    vectors = {tuple(body["data"][0]["embedding"]) for _, body, _ in results}
    assert len(vectors) == 1
    assert simulator.stats()["embedding_inputs"] == 1


async def test_partial_hits_send_only_misses_and_keep_input_order(simulator, start_broker):
    broker = await start_broker(emb_config(simulator))
    _, first, _ = await embed(broker, ["alpha", "beta"])
    before = simulator.stats()["embedding_inputs"]
    status, second, headers = await embed(broker, ["gamma", "alpha", "delta", "beta"])
    assert status == 200
    assert simulator.stats()["embedding_inputs"] - before == 2
    assert [d["index"] for d in second["data"]] == [0, 1, 2, 3]
    assert second["data"][1]["embedding"] == first["data"][0]["embedding"]
    assert second["data"][3]["embedding"] == first["data"][1]["embedding"]
    _, again, headers = await embed(broker, ["alpha", "beta"])
    assert headers["X-Broker-Cache"] == "hit"


async def test_base64_encoding_matches_the_float_result(simulator, start_broker):
    broker = await start_broker(emb_config(simulator))
    _, floats, _ = await embed(broker, "encode me")
    _, b64, _ = await embed(broker, "encode me", encoding_format="base64")
    decoded = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, np.asarray(floats["data"][0]["embedding"], dtype=np.float32))


async def test_cache_survives_a_broker_restart_through_redis(simulator, start_broker, redis_server):
    config = emb_config(simulator, redis={"url": redis_server.url})
    first = await start_broker(config)
    _, one, _ = await embed(first, ["kept in redis", "also kept"])
    await first.close()
    second = await start_broker(config)
    before = simulator.stats()["embedding_inputs"]
    status, two, headers = await embed(second, ["kept in redis", "also kept"])
    assert status == 200 and headers["X-Broker-Cache"] == "hit"
    assert simulator.stats()["embedding_inputs"] == before
    assert two["data"][0]["embedding"] == one["data"][0]["embedding"]


async def test_redis_stopped_mid_test_still_answers_correctly(simulator, start_broker, redis_server):
    broker = await start_broker(emb_config(simulator, redis={"url": redis_server.url}))
    _, warm, _ = await embed(broker, "before the outage")
    redis_server.stop()
    status, body, _ = await embed(broker, ["before the outage", "during the outage"])
    assert status == 200
    assert body["data"][0]["embedding"] == warm["data"][0]["embedding"]
    assert len(body["data"][1]["embedding"]) == 384


async def test_bad_embedding_input_gets_a_400_envelope(simulator, start_broker):
    broker = await start_broker(emb_config(simulator))
    for bad in ("", [], ["ok", ""]):
        status, body, _ = await embed(broker, bad)
        assert status == 400 and body["error"]["param"] == "input"


async def test_a_caller_past_its_deadline_gets_504_while_its_batch_still_answers_the_others(start_broker):
    async with await start_simulator(SimulatorConfig(latency_base_ms=600)) as sim:
        clock = FakeClock()
        broker = await start_broker(emb_config(sim, embeddings={"window_ms": 50}), clock=clock)
        both = asyncio.gather(embed(broker, "impatient text", broker={"timeout_s": 0.2}),
                              embed(broker, "patient text"))
        registry = broker.broker.metrics.registry
        # Both texts wait in one window (nothing sends the test an event across the HTTP boundary).
        await eventually(lambda: registry.get_sample_value("mergebroker_embedding_window_pending") == 2)
        clock.advance(0.2)  # the window closes (50 ms), then the impatient caller's deadline passes
        (late, late_body, _), (patient, _, _) = await both
        assert late == 504 and late_body["error"]["code"] == "deadline_exceeded"
        assert patient == 200
        assert sim.stats()["embedding_calls"] == 1  # one shared batch, not cancelled by the impatient caller


async def test_the_tiers_request_timeout_bounds_an_embeddings_request(start_broker):
    async with await start_simulator(SimulatorConfig(latency_base_ms=600)) as sim:
        broker = await start_broker(emb_config(sim, tiers=[{"name": "standard", "request_timeout_s": 0.2}]))
        status, body, _ = await embed(broker, "a slow text")
        assert status == 504 and body["error"]["code"] == "deadline_exceeded"


async def test_failed_requests_give_their_reserved_tokens_back(simulator, start_broker):
    broker = await start_broker(emb_config(simulator, tiers=[{"name": "standard", "tpm": 60}]))
    text = "a sentence of some sixteen tokens that the upstream is going to refuse every single time"
    simulator.set_faults(status_override=400)
    for i in range(3):  # 18 tokens each: with the last one, past the limit unless each failure settles to 0
        status, _, _ = await embed(broker, f"{text} {i}")
        assert status == 400
    simulator.set_faults(status_override=None)
    status, _, headers = await embed(broker, text)
    assert status == 200, headers


def _key_headers(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _two_tenants(scope: str) -> dict:
    keys = [{"sha256": hashlib.sha256(t.encode()).hexdigest(), "tenant": t} for t in ("alpha", "beta")]
    return {"auth": {"mode": "keys", "keys": keys}, "embeddings": {"window_ms": 5, "cache_scope": scope}}


async def test_tenant_cache_scope_keeps_one_tenants_cache_hits_from_another(simulator, start_broker):
    broker = await start_broker(emb_config(simulator, **_two_tenants("tenant")))
    await embed(broker, "a private text", headers=_key_headers("alpha"))
    status, _, headers = await embed(broker, "a private text", headers=_key_headers("beta"))
    assert status == 200 and headers["X-Broker-Cache"] == "miss"
    _, _, headers = await embed(broker, "a private text", headers=_key_headers("alpha"))
    assert headers["X-Broker-Cache"] == "hit"


async def test_the_global_cache_scope_shares_hits_across_tenants(simulator, start_broker):
    broker = await start_broker(emb_config(simulator, **_two_tenants("global")))
    await embed(broker, "a shared text", headers=_key_headers("alpha"))
    _, _, headers = await embed(broker, "a shared text", headers=_key_headers("beta"))
    assert headers["X-Broker-Cache"] == "hit"
