"""The providers' settings sections: where each upstream is, which models it serves, how it is called (timeouts,
limits, retries) and guarded (its circuit breaker)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, model_validator

from mergebroker.broker.engine.ground.section import Section as _Strict


class BreakerConfig(_Strict):
    window_s: float = Field(30.0, gt=0)
    min_calls: int = Field(10, gt=0)
    error_ratio: float = Field(0.10, gt=0, le=1)
    slow_ratio: float = Field(0.30, gt=0, le=1)
    slow_call_s: float = Field(10.0, gt=0, description="A call is slow past this plus its output tokens / token_rate.")
    open_s: float = Field(10.0, gt=0)
    open_backoff: float = Field(2.0, ge=1)
    open_max_s: float = Field(120.0, gt=0)
    half_open_probes: int = Field(1, gt=0)
    degrade_error_ratio: float = Field(0.05, ge=0, le=1)


class ProviderSettings(_Strict):
    name: str
    kind: Literal["openai", "local", "anthropic", "azure"] = "openai"
    base_url: str = ""
    models: list[str] = Field(default_factory=lambda: ["*"], description='Model names served; "*" = any.')
    api_key_env: str | None = Field(None, description="Environment variable holding this provider's API key.")
    api_key: SecretStr | None = Field(None, exclude=True)
    weight: int = Field(1, gt=0)
    max_connections: int = Field(100, gt=0, description="Keep-alive connections to this upstream, calls and streams.")
    max_in_flight: int | None = Field(None, gt=0)
    connect_timeout_s: float = Field(5.0, gt=0)
    token_rate: float = Field(50.0, gt=0, description="Expected output tokens/s; read timeout = max_tokens/rate + 5 s.")
    rpm: int | None = Field(None, gt=0)
    tpm: int | None = Field(None, gt=0)
    warmup_connections: int = Field(0, ge=0)
    early_release: bool | None = Field(
        None, description="Request merged calls as streams and answer each member as its block closes; default on "
                          "for the OpenAI-compatible kinds (openai, azure); false for an upstream that cannot stream.")
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)
    anthropic_version: str = Field("2023-06-01", min_length=1, description="kind anthropic: anthropic-version header.")
    structured_output_models: list[str] | None = Field(
        None, description="kind anthropic: the Anthropic models (glob patterns) given response_format json_schema "
                          "as native structured output; others get the forced-tool technique. Default: the built-in "
                          "list (providers/anthropic/structured.py).")
    model_map: dict[str, str] = Field(default_factory=dict,
                                      description="kinds anthropic and openai: callers' model name -> upstream's.")
    responses: Literal["auto", "native", "translate"] = Field(
        "auto", description="kind openai: send /v1/responses as sent (native), as Chat Completions (translate), or "
                            "try it and remember a 404/405 (auto).")
    api_version: str = Field("2024-10-21", min_length=1, description="kind azure: the api-version query parameter.")
    deployments: dict[str, str] = Field(default_factory=dict,
                                        description="kind azure: callers' model name -> deployment name.")
    batch_api: bool = Field(False, description="Send bulk jobs through this provider's own Batch API "
                                               "(/v1/files + /v1/batches) instead of call by call.")

    @model_validator(mode="after")
    def _kind_fields(self) -> ProviderSettings:
        if self.model_map and self.kind not in ("anthropic", "openai"):
            raise ValueError(f"providers.{self.name}.model_map: only for kinds 'anthropic' and 'openai'")
        if self.deployments and self.kind != "azure":
            raise ValueError(f"providers.{self.name}.deployments: only for kind 'azure'")
        return self

    @property
    def releases_early(self) -> bool:
        """`early_release`, defaulting to on for the OpenAI-compatible kinds."""
        return self.early_release if self.early_release is not None else self.kind in ("openai", "azure")


HTTP_PROVIDER_KINDS = ("openai", "anthropic", "azure")
"""Provider kinds reached over HTTP (each gets a breaker and a place in the pools); "local" runs in process."""


class RetrySettings(_Strict):
    attempts: int = Field(3, ge=1, le=10)
    backoff_base_s: float = Field(0.1, ge=0)
    backoff_max_s: float = Field(5.0, ge=0)
    max_retry_after_s: float = Field(30.0, ge=0)
