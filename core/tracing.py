"""Traces and the GenAI client metrics over OpenTelemetry (OTLP over HTTP/protobuf), off unless installed.

`install(config)` builds a `TracerProvider` (batching to an `OTLPSpanExporter`) and a `MeterProvider`
(the two `gen_ai.client.*` histograms) for this process; `uninstall()` flushes and removes them. Until then
every helper here is a no-op behind one check (`_telemetry is None`): no OpenTelemetry call at all on the
request path, so off costs nothing. The providers are this module's own, never OpenTelemetry's globals, so
an embedding application's tracing is left alone and tests can install and remove them freely.

The layers above use it like this: the HTTP way in opens a SERVER span per request (`server_span`), which
is current while the request is handled; a queued job keeps `current()` (an opaque `TraceContext`) so that
the dispatcher can make it the parent of the job's own upstream call (`parent`) or, for a merged call, link
the call to every member (`merged_call`); the pools open a CLIENT span per upstream attempt
(`start_attempt`), which is current while the request goes out, so `inject` writes its `traceparent`.
Prompt and answer text is recorded only when `TelemetryConfig.record_content` says so.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)
"""`gen_ai.client.token.usage` bucket boundaries, as the GenAI semantic conventions advise."""
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
"""`gen_ai.client.operation.duration` bucket boundaries (seconds), as the conventions advise."""
SCOPE = "mergebroker"


@dataclass(frozen=True)
class TelemetryConfig:
    """What `install` builds: where spans and metrics go, who sends them, what is recorded.

    `traces_url` and `metrics_url` are full OTLP/HTTP URLs (…/v1/traces, …/v1/metrics); a None metrics
    URL records no metrics. `sample_ratio` samples new traces (a caller's sampled flag is followed).
    """

    traces_url: str
    metrics_url: str | None = None
    service_name: str = "mergebroker"
    record_content: bool = False
    sample_ratio: float = 1.0
    export_interval_s: float = 60.0


@dataclass(frozen=True, slots=True)
class TraceContext:
    """An opaque handle on one span (its OpenTelemetry `SpanContext`): what a job carries into the dispatcher
    to parent or link its upstream call, and, as `traceparent`, over the cluster's wire."""

    span_context: Any


@dataclass(frozen=True, slots=True)
class _CallTrace:
    links: tuple[TraceContext, ...]
    batch_id: str
    batch_size: int


_call: contextvars.ContextVar[_CallTrace | None] = contextvars.ContextVar("mergebroker_merged_call", default=None)


@dataclass
class Telemetry:
    """The installed providers; `force_flush` and `shutdown` block (they export over HTTP): off the loop."""

    config: TelemetryConfig
    tracer_provider: Any
    meter_provider: Any | None
    tracer: Any
    propagator: Any
    token_usage: Any | None = None
    duration: Any | None = None

    def force_flush(self, timeout_ms: int = 10_000) -> bool:
        """Export every ended span (and the metrics so far) now; True when all went out."""
        ok = self.tracer_provider.force_flush(timeout_ms)
        if self.meter_provider is not None:
            ok = self.meter_provider.force_flush(timeout_ms) and ok
        return bool(ok)

    def shutdown(self) -> None:
        """Flush and stop the exporters."""
        self.tracer_provider.shutdown()
        if self.meter_provider is not None:
            self.meter_provider.shutdown()


_telemetry: Telemetry | None = None
"""The one switch: None while tracing is off."""


def install(config: TelemetryConfig, *, span_exporter: Any = None, metric_reader: Any = None) -> Telemetry:
    """Turn tracing on for this process with `config` (exporters may be given, for tests and benchmarks)."""
    global _telemetry
    from opentelemetry import propagate
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio

    if _telemetry is not None:
        raise RuntimeError("telemetry is already installed in this process")
    resource = Resource.create({"service.name": config.service_name})
    tracer_provider = TracerProvider(sampler=ParentBasedTraceIdRatio(config.sample_ratio), resource=resource,
                                     shutdown_on_exit=False)
    tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter or OTLPSpanExporter(config.traces_url)))
    meter_provider = None
    if metric_reader is None and config.metrics_url is not None:
        metric_reader = PeriodicExportingMetricReader(OTLPMetricExporter(config.metrics_url),
                                                      export_interval_millis=config.export_interval_s * 1000)
    telemetry = Telemetry(config, tracer_provider, None, tracer_provider.get_tracer(SCOPE),
                          propagate.get_global_textmap())
    if metric_reader is not None:
        # No exemplars: sampling one per measurement about doubles what each `record` costs.
        meter_provider = MeterProvider([metric_reader], resource=resource, shutdown_on_exit=False,
                                       exemplar_filter=AlwaysOffExemplarFilter())
        meter = meter_provider.get_meter(SCOPE)
        telemetry.meter_provider = meter_provider
        telemetry.token_usage = meter.create_histogram(
            "gen_ai.client.token.usage", unit="{token}", description="Tokens used per upstream attempt.",
            explicit_bucket_boundaries_advisory=TOKEN_BUCKETS)
        telemetry.duration = meter.create_histogram(
            "gen_ai.client.operation.duration", unit="s", description="Duration of each upstream attempt.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS)
    _telemetry = telemetry
    return telemetry


def uninstall() -> None:
    """Turn tracing off again, flushing what was recorded (blocks: export over HTTP)."""
    global _telemetry
    telemetry, _telemetry = _telemetry, None
    if telemetry is not None:
        telemetry.shutdown()


def installed() -> Telemetry | None:
    """The installed telemetry, or None while off."""
    return _telemetry


def enabled() -> bool:
    """Whether tracing is on in this process."""
    return _telemetry is not None


def record_content() -> bool:
    """Whether prompt and answer text may be recorded on spans (off unless configured)."""
    return _telemetry is not None and _telemetry.config.record_content


def current() -> TraceContext | None:
    """The current span as a `TraceContext` to carry along (None while off or outside any span)."""
    if _telemetry is None:
        return None
    span_context = trace.get_current_span().get_span_context()
    return TraceContext(span_context) if span_context.is_valid else None


def inject(headers: Mapping[str, str]) -> dict[str, str]:
    """A copy of `headers` with the current span's `traceparent` added (while off: just the copy, so callers on
    a hot path ask `enabled()` first)."""
    carrier = dict(headers)
    if _telemetry is not None:
        _telemetry.propagator.inject(carrier)
    return carrier


def traceparent(ctx: TraceContext | None) -> str | None:
    """`ctx` as a W3C `traceparent` value (None while off or without a context)."""
    if _telemetry is None or ctx is None:
        return None
    carrier: dict[str, str] = {}
    _telemetry.propagator.inject(carrier, context=trace.set_span_in_context(trace.NonRecordingSpan(ctx.span_context)))
    return carrier.get("traceparent")


def from_traceparent(value: str | None) -> TraceContext | None:
    """The `TraceContext` a `traceparent` value names (None while off, or when it names none)."""
    if _telemetry is None or not value:
        return None
    span_context = trace.get_current_span(_telemetry.propagator.extract({"traceparent": value})).get_span_context()
    return TraceContext(span_context) if span_context.is_valid else None


class _Noop:
    """What the scope helpers return while off (or with nothing to do): enters and exits at no cost."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: object) -> None:
        return None


_NOOP = _Noop()


class _Attached:
    __slots__ = ("_ctx", "_token")

    def __init__(self, ctx: Any) -> None:
        self._ctx = ctx
        self._token: Any = None

    def __enter__(self) -> None:
        self._token = otel_context.attach(self._ctx)

    def __exit__(self, *_: object) -> None:
        otel_context.detach(self._token)


def parent(ctx: TraceContext | None) -> _Attached | _Noop:
    """A scope in which `ctx` is the current span: a queued job's upstream call becomes its child."""
    if _telemetry is None or ctx is None:
        return _NOOP
    return _Attached(trace.set_span_in_context(trace.NonRecordingSpan(ctx.span_context)))


class _MergedCall:
    __slots__ = ("_trace", "_token")

    def __init__(self, call: _CallTrace) -> None:
        self._trace = call
        self._token: Any = None

    def __enter__(self) -> None:
        self._token = _call.set(self._trace)

    def __exit__(self, *_: object) -> None:
        _call.reset(self._token)


def merged_call(batch_id: str, members: Iterable[TraceContext | None]) -> _MergedCall | _Noop:
    """A scope in which upstream attempts serve a merged call: each attempt's span links to every member's
    span and names the batch (`members` is read only while on)."""
    if _telemetry is None:
        return _NOOP
    links = tuple(m for m in members if m is not None)
    return _MergedCall(_CallTrace(links, batch_id, len(links)))


class ServerSpan:
    """One inbound request's SERVER span, current from `start_server` until `detach`; `end` once."""

    __slots__ = ("span", "_token")

    def __init__(self, span: Any, token: Any) -> None:
        self.span = span
        self._token = token

    def detach(self) -> None:
        """Stop being the current span (the span itself may end later, once its usage has settled)."""
        if self._token is not None:
            otel_context.detach(self._token)
            self._token = None

    def end(self, attributes: Mapping[str, Any], status: int) -> None:
        """Record `attributes` (None values are left out) and the response `status`, and end the span."""
        found = {k: v for k, v in attributes.items() if v is not None}
        found["http.response.status_code"] = status
        if status >= 500:
            found["error.type"] = str(status)
            self.span.set_status(Status(StatusCode.ERROR))
        self.span.set_attributes(found)
        self.span.end()


def start_server(method: str, route: str, path: str, headers: Mapping[str, str]) -> ServerSpan | None:
    """Open the SERVER span of one inbound request (continuing the caller's `traceparent`) and make it current."""
    if _telemetry is None:
        return None
    caller = _telemetry.propagator.extract(headers)
    span = _telemetry.tracer.start_span(f"{method} {route}", context=caller, kind=SpanKind.SERVER, attributes={
        "http.request.method": method, "url.path": path, "http.route": route})
    return ServerSpan(span, otel_context.attach(trace.set_span_in_context(span)))


@dataclass(frozen=True, slots=True)
class Peer:
    """Who an upstream attempt goes to: the GenAI provider name and the server's address."""

    provider: str  # gen_ai.provider.name: openai, anthropic, azure.ai.openai
    address: str | None = None
    port: int | None = None


class AttemptSpan:
    """One upstream attempt's CLIENT span (current while the request goes out) and its GenAI metrics."""

    __slots__ = ("span", "_token", "_started", "_metric_attrs", "_ended")

    def __init__(self, span: Any, token: Any, started: float, metric_attrs: dict[str, Any]) -> None:
        self.span = span
        self._token = token
        self._started = started
        self._metric_attrs = metric_attrs
        self._ended = False

    def detach(self) -> None:
        """Stop being the current span (a stream's span ends later, with the stream)."""
        if self._token is not None:
            otel_context.detach(self._token)
            self._token = None

    def succeeded(self, now: float, *, response_model: str | None = None, input_tokens: int | None = None,
                  output_tokens: int | None = None, cache_read_tokens: int | None = None,
                  finish_reasons: Iterable[str] = (), output_text: str | None = None) -> None:
        """End the span as answered, with what the reply reported; record the metrics."""
        if self._ended:
            return
        found: dict[str, Any] = {}
        if response_model:
            found["gen_ai.response.model"] = self._metric_attrs["gen_ai.response.model"] = response_model
        for name, value in (("gen_ai.usage.input_tokens", input_tokens),
                            ("gen_ai.usage.output_tokens", output_tokens),
                            ("gen_ai.usage.cache_read.input_tokens", cache_read_tokens)):
            if value is not None:
                found[name] = value
        reasons = [r for r in finish_reasons if r]
        if reasons:
            found["gen_ai.response.finish_reasons"] = reasons
        if output_text is not None and record_content():
            found["gen_ai.output.messages"] = output_text
        self.span.set_attributes(found)
        self._end(now, input_tokens, output_tokens)

    def failed(self, now: float, exc: BaseException) -> None:
        """End the span as failed with `exc` (its class as `error.type`, status ERROR)."""
        if self._ended:
            return
        error_type = getattr(exc, "code", None) or type(exc).__name__
        self.span.set_attribute("error.type", str(error_type))
        self.span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
        self._metric_attrs["error.type"] = str(error_type)
        self._end(now, None, None)

    def _end(self, now: float, input_tokens: int | None, output_tokens: int | None) -> None:
        self._ended = True
        self.span.end()
        telemetry = _telemetry
        if telemetry is None or telemetry.duration is None or telemetry.token_usage is None:
            return
        attrs = self._metric_attrs
        telemetry.duration.record(max(0.0, now - self._started), attrs)
        if input_tokens is not None:
            telemetry.token_usage.record(input_tokens, {**attrs, "gen_ai.token.type": "input"})
        if output_tokens is not None:
            telemetry.token_usage.record(output_tokens, {**attrs, "gen_ai.token.type": "output"})


def start_attempt(operation: str, model: str, peer: Peer, now: float,
                  input_text: str | None = None) -> AttemptSpan | None:
    """Open the CLIENT span `{operation} {model}` of one upstream attempt and make it current. Inside a
    `merged_call` scope it is a new trace linked to every member; else the current span's child."""
    if _telemetry is None:
        return None
    attrs: dict[str, Any] = {"gen_ai.operation.name": operation, "gen_ai.provider.name": peer.provider,
                             "gen_ai.request.model": model}
    metric_attrs = dict(attrs)
    if peer.address is not None:
        attrs["server.address"] = metric_attrs["server.address"] = peer.address
    if peer.port is not None:
        attrs["server.port"] = metric_attrs["server.port"] = peer.port
    if input_text is not None and _telemetry.config.record_content:
        attrs["gen_ai.input.messages"] = input_text
    call, links, ctx = _call.get(), [], None
    if call is not None:
        links = [Link(m.span_context) for m in call.links]
        attrs["mergebroker.batch_id"], attrs["mergebroker.batch_size"] = call.batch_id, call.batch_size
        ctx = otel_context.Context()  # a merged call serves several traces: its own, linked to each
    span = _telemetry.tracer.start_span(f"{operation} {model}", context=ctx, kind=SpanKind.CLIENT,
                                        attributes=attrs, links=links)
    return AttemptSpan(span, otel_context.attach(trace.set_span_in_context(span)), now, metric_attrs)
