"""The `telemetry:` section: OpenTelemetry traces and GenAI metrics over OTLP/HTTP, off by default.

`enabled: null` (the default) means "on when the standard OpenTelemetry environment asks for it": an
OTLP endpoint is set (`OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) and
`OTEL_SDK_DISABLED` is not true. `resolved(environ)` decides that once, where settings are loaded; a
section never resolved counts as off.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field

from mergebroker.tracing import TelemetryConfig

DEFAULT_ENDPOINT = "http://localhost:4318"


class TelemetrySettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool | None = Field(
        None, description="Export traces and GenAI metrics; default: on when OTEL_EXPORTER_OTLP_ENDPOINT or "
                          "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set and OTEL_SDK_DISABLED is not true.")
    endpoint: str | None = Field(
        None, description="OTLP/HTTP base URL (/v1/traces and /v1/metrics are added); default: "
                          "OTEL_EXPORTER_OTLP_ENDPOINT, else http://localhost:4318.")
    traces_endpoint: str | None = Field(None, description="Full traces URL; default: "
                                                          "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else endpoint.")
    metrics_endpoint: str | None = Field(None, description="Full metrics URL; default: "
                                                           "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT, else endpoint.")
    metrics: bool = Field(True, description="Also export gen_ai.client.token.usage and .operation.duration.")
    metrics_interval_s: float = Field(60.0, gt=0, description="How often metrics are exported.")
    service_name: str = Field("mergebroker", min_length=1)
    record_content: bool = Field(False, description="Record prompts and answers on upstream spans (off: no text "
                                                    "of any request is ever exported).")
    sample_ratio: float = Field(1.0, ge=0, le=1, description="Share of new traces sampled (a caller's "
                                                             "traceparent decides for its own).")

    def resolved(self, environ: Mapping[str, str]) -> TelemetrySettings:
        """This section with `enabled` and the endpoints decided from `environ` (the OTEL_* variables)."""
        base = self.endpoint or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        traces = self.traces_endpoint or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        metrics = self.metrics_endpoint or environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
        enabled = self.enabled
        if enabled is None:
            disabled = environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
            enabled = bool(environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                           or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")) and not disabled
        return self.model_copy(update={"enabled": enabled, "endpoint": base, "traces_endpoint": traces,
                                       "metrics_endpoint": metrics})

    def config(self) -> TelemetryConfig:
        """What `mergebroker.tracing.install` builds for this section."""
        return TelemetryConfig(self.traces_url(), self.metrics_url(), service_name=self.service_name,
                               record_content=self.record_content, sample_ratio=self.sample_ratio,
                               export_interval_s=self.metrics_interval_s)

    def traces_url(self) -> str:
        """Where spans are sent."""
        return self.traces_endpoint or _joined(self.endpoint, "/v1/traces")

    def metrics_url(self) -> str | None:
        """Where metrics are sent (None: no metrics)."""
        if not self.metrics:
            return None
        return self.metrics_endpoint or _joined(self.endpoint, "/v1/metrics")


def _joined(base: str | None, path: str) -> str:
    return (base or DEFAULT_ENDPOINT).rstrip("/") + path
