"""The HTTP upstreams of a broker's providers: one client of each provider's kind, paced and behind its breaker."""

from __future__ import annotations

from mergebroker.breaker.circuit import BreakerSettings, CircuitBreaker
from mergebroker.broker.engine.ground.settings import HTTP_PROVIDER_KINDS, ProviderSettings
from mergebroker.clock import Clock
from mergebroker.providers.anthropic.provider import AnthropicProvider
from mergebroker.providers.anthropic.structured import NATIVE_STRUCTURED_OUTPUT
from mergebroker.providers.openai.azure import AzureOpenAIProvider
from mergebroker.providers.openai.compat import HttpProviderSettings, OpenAICompatProvider
from mergebroker.providers.pacing import UpstreamLimiter
from mergebroker.providers.upstream import Upstream


def build_upstreams(providers: list[ProviderSettings], breakers: dict[str, CircuitBreaker], clock: Clock,
                    default_max_tokens: int) -> list[Upstream]:
    """One `Upstream` per HTTP provider, in configuration order (a local model is no upstream)."""
    return [_upstream(p, breakers[p.name], clock, default_max_tokens)
            for p in providers if p.kind in HTTP_PROVIDER_KINDS]


def breaker_settings(p: ProviderSettings) -> BreakerSettings:
    return BreakerSettings(**p.breaker.model_dump())


def _provider(p: ProviderSettings, default_max_tokens: int) -> OpenAICompatProvider:
    """The HTTP provider of `p.kind`; Anthropic's fills a missing `max_tokens` with the merge default."""
    http = HttpProviderSettings(name=p.name, base_url=p.base_url.rstrip("/"),
                                api_key=p.api_key.get_secret_value() if p.api_key else None,
                                max_connections=p.max_connections, connect_timeout_s=p.connect_timeout_s,
                                responses=p.responses, model_map=tuple(p.model_map.items()))
    if p.kind == "anthropic":
        native = NATIVE_STRUCTURED_OUTPUT if p.structured_output_models is None else p.structured_output_models
        return AnthropicProvider(http, default_max_tokens=default_max_tokens, anthropic_version=p.anthropic_version,
                                 model_map=p.model_map, native_structured_output=native)
    if p.kind == "azure":
        return AzureOpenAIProvider(http, api_version=p.api_version, deployments=p.deployments)
    return OpenAICompatProvider(http)


def _upstream(p: ProviderSettings, breaker: CircuitBreaker, clock: Clock, default_max_tokens: int) -> Upstream:
    provider = _provider(p, default_max_tokens)
    limiter = UpstreamLimiter(p.rpm, p.tpm, clock=clock) if (p.rpm or p.tpm) else None
    return Upstream(provider, models=tuple(p.models), weight=p.weight, breaker=breaker, limiter=limiter,
                    max_in_flight=p.max_in_flight, token_rate=p.token_rate, streams_merged=p.releases_early)
