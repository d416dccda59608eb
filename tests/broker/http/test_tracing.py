"""Traces over OTLP: one SERVER span per request with its apportioned account, one CLIENT span per upstream
attempt with the GenAI attributes, merged calls linked to every member, no prompt text, and nothing at all
while telemetry is off."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from mergebroker import tracing
from mergebroker.broker.engine.ground.telemetry_settings import TelemetrySettings
from mergebroker.broker.http.tracing import TELEMETRY, tracing_middleware
from mergebroker.clock import FakeClock
from tests.broker.engine.chat.test_merging import BATCH, ask_all
from tests.broker.engine.chat.test_merging import config as merging_config
from tests.conftest import provider_for
from tests.helpers.polling import wait_until

PRICE = {"input": 2.5, "cached_input": 1.25, "output": 10}


@dataclass
class Receiver:
    """An OTLP/HTTP collector on a loopback port: it keeps every body it was sent, raw."""

    url: str
    traces: list[bytes] = field(default_factory=list)
    metrics: list[bytes] = field(default_factory=list)

    def spans(self) -> list[Span]:
        found = []
        for raw in self.traces:
            request = ExportTraceServiceRequest.FromString(raw)
            found += [s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
        return found

    def metric_names(self) -> set[str]:
        names = set()
        for raw in self.metrics:
            request = ExportMetricsServiceRequest.FromString(raw)
            names |= {m.name for rm in request.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
        return names


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    app = web.Application()
    sink = Receiver("")

    def keep(into: list[bytes]):
        async def handler(request: web.Request) -> web.Response:
            into.append(await request.read())
            return web.Response(body=b"", content_type="application/x-protobuf")
        return handler

    app.router.add_post("/v1/traces", keep(sink.traces))
    app.router.add_post("/v1/metrics", keep(sink.metrics))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    sink.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield sink
    await runner.cleanup()


def attrs(span: Span) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in span.attributes:
        value = kv.value
        kind = value.WhichOneof("value")
        out[kv.key] = list(v.string_value for v in value.array_value.values) if kind == "array_value" \
            else getattr(value, kind)
    return out


def traced_config(sim, receiver: Receiver, **provider: Any) -> dict[str, Any]:
    return merging_config(sim, providers=[provider_for(sim, **provider)], pricing={"sim-small": PRICE},
                          merge={"embedder": "none", "policy": "always"},
                          telemetry={"enabled": True, "endpoint": receiver.url, "metrics_interval_s": 3600})


async def flushed(broker) -> None:
    """Export everything recorded so far (the exporter posts synchronously: off the loop the receiver runs on)."""
    telemetry = broker.runner.app[TELEMETRY]
    assert await asyncio.to_thread(telemetry.force_flush)


QUESTIONS = [f"Summarise chapter {i} of the confidential handbook zq{i}x" for i in range(8)]


async def test_a_merged_call_links_to_every_member_and_members_carry_their_share(receiver, simulator, start_broker):
    clock = FakeClock()
    broker = await start_broker(traced_config(simulator, receiver, early_release=False), clock=clock)
    caller_trace = "0af7651916cd43dd8448eb211c80319c"
    headers = {**BATCH, "traceparent": f"00-{caller_trace}-b7ad6b7169203331-01"}
    results = await ask_all(broker, QUESTIONS, headers=headers, clock=clock)
    assert all(status == 200 and h["X-Broker-Batch-Size"] == "8" for status, _, h in results)
    assert simulator.stats()["chat_calls"] == 1
    await flushed(broker)

    spans = receiver.spans()
    servers = [s for s in spans if s.kind == Span.SPAN_KIND_SERVER]
    clients = [s for s in spans if s.kind == Span.SPAN_KIND_CLIENT]
    assert len(servers) == 8 and len(clients) == 1
    assert all(s.trace_id.hex() == caller_trace for s in servers)  # the caller's traceparent is continued
    call = clients[0]
    assert {(link.trace_id, link.span_id) for link in call.links} == {(s.trace_id, s.span_id) for s in servers}
    call_attrs = attrs(call)
    assert call.name == "chat sim-small"
    assert call_attrs["gen_ai.operation.name"] == "chat" and call_attrs["gen_ai.provider.name"] == "openai"
    assert call_attrs["gen_ai.request.model"] == "sim-small" and call_attrs["gen_ai.response.model"]
    assert call_attrs["gen_ai.usage.input_tokens"] > 0 and call_attrs["gen_ai.usage.output_tokens"] > 0
    assert call_attrs["gen_ai.response.finish_reasons"] == ["stop"]
    assert call_attrs["server.address"] == "127.0.0.1" and call_attrs["server.port"] == simulator.port
    assert call_attrs["mergebroker.batch_size"] == 8
    batch_id = results[0][2]["X-Broker-Batch-Id"]
    assert call_attrs["mergebroker.batch_id"] == batch_id

    member_inputs = 0
    for span in servers:
        a = attrs(span)
        assert a["http.request.method"] == "POST" and a["url.path"] == "/v1/chat/completions"
        assert a["http.response.status_code"] == 200
        assert a["mergebroker.tier"] == "batch" and a["mergebroker.tenant"] == "default"
        assert a["mergebroker.cache"] == "miss" and a["mergebroker.merge_decision"] == "merged"
        assert a["mergebroker.batch_id"] == batch_id and a["mergebroker.batch_size"] == 8
        assert 0 < a["gen_ai.usage.input_tokens"] < call_attrs["gen_ai.usage.input_tokens"]
        assert a["gen_ai.usage.output_tokens"] > 0
        assert a["mergebroker.usd_actual"] > 0 and a["mergebroker.usd_alone"] > 0
        member_inputs += a["gen_ai.usage.input_tokens"]
    assert member_inputs == call_attrs["gen_ai.usage.input_tokens"]  # apportioned: the shares add up

    exported = b"".join(receiver.traces)
    for question in QUESTIONS:
        assert question.encode() not in exported
    assert b"confidential" not in exported and b"zq3x" not in exported


async def test_early_released_members_end_their_spans_once_usage_settles(receiver, simulator, start_broker):
    clock = FakeClock()
    broker = await start_broker(traced_config(simulator, receiver), clock=clock)
    results = await ask_all(broker, QUESTIONS, headers=BATCH, clock=clock)
    assert all(status == 200 for status, _, _ in results)

    async def eight_members_ended() -> bool:  # each member's span ends once the merged stream's usage settles
        await flushed(broker)
        return len([s for s in receiver.spans() if s.kind == Span.SPAN_KIND_SERVER]) == 8
    await wait_until(eight_members_ended, 10, "the members' spans never ended")
    servers = [s for s in receiver.spans() if s.kind == Span.SPAN_KIND_SERVER]
    clients = [s for s in receiver.spans() if s.kind == Span.SPAN_KIND_CLIENT]
    assert len(clients) == 1 and len(clients[0].links) == 8
    assert len(servers) == 8
    assert all(attrs(s)["gen_ai.usage.output_tokens"] > 0 for s in servers)


async def test_a_retried_attempt_gets_a_span_of_its_own(receiver, simulator, start_broker):
    broker = await start_broker(traced_config(simulator, receiver))
    simulator.set_faults(fail_first_n=1)
    status, _, _ = await broker.chat("What is the capital of France?")
    assert status == 200
    await flushed(broker)
    clients = [s for s in receiver.spans() if s.kind == Span.SPAN_KIND_CLIENT]
    server = next(s for s in receiver.spans() if s.kind == Span.SPAN_KIND_SERVER)
    assert len(clients) == 2
    failed, answered = sorted(clients, key=lambda s: s.start_time_unix_nano)
    assert failed.status.code == failed.status.STATUS_CODE_ERROR and attrs(failed)["error.type"]
    assert answered.status.code != answered.status.STATUS_CODE_ERROR
    assert all(c.trace_id == server.trace_id and c.parent_span_id == server.span_id for c in clients)
    assert b"capital of France" not in b"".join(receiver.traces)
    async with broker.http.get(simulator.url + "/_sim/last_request") as resp:
        sent = (await resp.json())["headers"]
    assert sent["traceparent"].split("-")[1:3] == [answered.trace_id.hex(), answered.span_id.hex()]


async def test_attempts_record_the_genai_metrics(receiver, simulator, start_broker):
    broker = await start_broker(traced_config(simulator, receiver))
    status, _, _ = await broker.chat("Name a colour")
    assert status == 200
    await flushed(broker)
    assert {"gen_ai.client.token.usage", "gen_ai.client.operation.duration"} <= receiver.metric_names()


async def test_off_installs_nothing_and_registers_no_middleware(simulator, start_broker):
    broker = await start_broker({"providers": [provider_for(simulator)]})
    status, _, _ = await broker.chat("Hello")
    assert status == 200
    app = broker.runner.app
    assert tracing_middleware not in app.middlewares and TELEMETRY not in app
    assert not tracing.enabled() and tracing.current() is None
    assert tracing.start_attempt("chat", "m", tracing.Peer("openai"), 0.0) is None


def test_the_environment_decides_when_enabled_is_unset():
    section = TelemetrySettings()
    assert section.resolved({}).enabled is False
    on = section.resolved({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert on.enabled and on.traces_url() == "http://collector:4318/v1/traces"
    assert on.metrics_url() == "http://collector:4318/v1/metrics"
    assert not section.resolved({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c/v1/traces",
                                 "OTEL_SDK_DISABLED": "true"}).enabled
    assert TelemetrySettings(enabled=False).resolved({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}).enabled is False


def test_a_jobs_traceparent_crosses_the_cluster_wire_only_when_set():
    from mergebroker.broker.cluster.wire import FIELD, WireJob, decode_job, encode_job
    from mergebroker.broker.engine.limits.admission import Caller

    job = WireJob("c1", "replies", "r1", Caller("t", "batch"), {"model": "m"}, None, "fk", 1, 2, 3,
                  traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    assert decode_job(encode_job(job)).traceparent == job.traceparent
    plain = encode_job(WireJob("c1", "replies", "r1", Caller("t", "batch"), {"model": "m"}, None, "fk", 1, 2, 3))
    assert b'"tp"' not in plain[FIELD] and decode_job(plain).traceparent is None


def test_the_standard_otel_variables_switch_telemetry_on_through_the_settings():
    """A deployment that sets OTEL_EXPORTER_OTLP_ENDPOINT gets traces without a telemetry: section; OTEL_SDK_DISABLED
    and an explicit `enabled: false` win over it; with neither, telemetry is off."""
    from mergebroker.broker.engine.ground.config import load_settings

    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}
    assert load_settings(None, environ={}).telemetry.enabled is False
    assert load_settings(None, environ=endpoint).telemetry.enabled is True
    assert load_settings(None, environ={**endpoint, "OTEL_SDK_DISABLED": "true"}).telemetry.enabled is False
    assert load_settings(None, environ=endpoint, overrides={"telemetry": {"enabled": False}}).telemetry.enabled is False
