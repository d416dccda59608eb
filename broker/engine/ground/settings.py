"""Settings: the one `Settings` model and its nested sections, with their defaults and checks.

They are loaded (YAML file, `MERGEBROKER_*` environment, CLI overrides, secrets) by `engine.ground.config`.
Components receive plain values from these models, never the models' sources. The providers' sections (where
the upstreams are, how they are called and guarded) live in `provider_settings`; they are imported here with
the rest, so `Settings` and every section can be imported from this module.
"""


from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from mergebroker.broker.engine.ground.provider_settings import (
    HTTP_PROVIDER_KINDS,
    ProviderSettings,
    RetrySettings,
)
from mergebroker.broker.engine.ground.section import Section as _Strict
from mergebroker.broker.engine.ground.telemetry_settings import TelemetrySettings
from mergebroker.merge.pricing import PriceTable

HARD_MAX_BATCH = 8


class ServerSettings(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    max_body_bytes: int = Field(4 * 1024 * 1024, gt=0, description="Requests over this size get 413.")
    workers: int = Field(64, gt=0, description="Tasks taking released groups by priority; each group is dispatched "
                                               "in its own task, so a hung upstream holds no worker.")
    aging_per_s: float = Field(10.0, ge=0, description="Priority points a released group gains per second waited.")
    header_timeout_s: float = Field(10.0, gt=0, description="Longest a client may take to send a request's headers.")
    body_timeout_s: float = Field(30.0, gt=0, description="Longest a client may take to send a request's body (408).")
    idle_timeout_s: float = Field(
        75.0, gt=0, description="Keep-alive: an idle client connection closes after this. Longer than clients' "
        "and load balancers' own idle timeouts (AWS ALB 60 s), so that they close first and never reuse a "
        "connection the broker is closing.")
    max_connections: int | None = Field(
        None, gt=0, description="Client connections per process; past it, stalled ones are closed first "
                                "(default: the open-file limit minus reserved_fds and providers' connections).")
    reserved_fds: int = Field(128, ge=0, description="Descriptors kept for Redis, logs and files by the default cap.")
    backlog: int = Field(128, gt=0, description="Listen backlog.")
    max_json_depth: int = Field(64, ge=2, description="Deepest nesting a request body may have (400 above).")
    max_messages: int = Field(2048, gt=0, description="Most messages one chat request may hold (400 above).")
    accept_error_log_interval_s: float = Field(10.0, gt=0, description="Out-of-descriptor accept errors log once per this.")
    event_loop: Literal["auto", "uvloop", "asyncio"] = Field(
        "auto", description="The serving event loop: uvloop when installed (auto), or the standard asyncio loop.")
    drain_timeout_s: float = Field(
        600.0, ge=0, validation_alias=AliasChoices("drain_timeout_s", "drain_s"),
        description="At shutdown, requests and streams in flight get this long to finish (agent streams run for "
        "minutes), then a clean error; the drain ends as soon as nothing is in flight. Alias: drain_s.")
    metrics_token_env: str | None = Field(
        None, description="Environment variable holding a bearer token that /metrics and /v1/broker/stats require.")
    metrics_token: SecretStr | None = Field(None, exclude=True)


class TierSettings(_Strict):
    name: str
    priority: int = 0
    window_ms: float = Field(50.0, ge=0)
    max_batch: int = Field(4, ge=1, le=HARD_MAX_BATCH)
    max_queue: int = Field(200, gt=0)
    hard_cap: int | None = Field(None, gt=0, description="Queue size past which requests get 503; default 2x max_queue.")
    rpm: int | None = Field(None, gt=0)
    tpm: int | None = Field(None, gt=0)
    request_timeout_s: float = Field(60.0, gt=0)
    merge: bool = True
    similarity_threshold: float = Field(0.85, ge=0, le=1)
    similarity_budget_ms: float = Field(
        1000.0, ge=0, description="Longest a group waits for its prompt vectors, from its first arrival, before it "
                                  "is sent unmerged (the built-in realtime tier: 200 ms). On a quiet host vectors "
                                  "are ready within the window; the budget binds on a busy host, where merging a "
                                  "burst late saves more calls than sending it at once.")
    omitted_temperature_is_zero: bool = False
    system_prompts: Literal["exact", "tagged"] = "exact"
    window_policy: Literal["adaptive", "fixed"] = Field(
        "adaptive", description="adaptive: a request that likely gets no partner within the window is sent at once.")
    window_min_partners: float = Field(
        0.1, ge=0, description="adaptive: wait only when at least this many partners are expected in the window.")
    merge_streams: bool | None = Field(
        None, description="stream: true requests may merge, each member streaming its own block (default: on for "
                          "batch only, since a later member's first token waits for the earlier blocks).")

    @property
    def streams_merge(self) -> bool:
        """Whether streaming requests of this tier may merge (`merge_streams`; default: the batch tier only)."""
        return self.merge_streams if self.merge_streams is not None else self.name == "batch"

    @property
    def queue_hard_cap(self) -> int:
        return self.hard_cap or 2 * self.max_queue

    def timeout_for(self, requested_s: float | None) -> float:
        """Seconds a request may take: this tier's limit, or the caller's `broker.timeout_s` when shorter."""
        return min(self.request_timeout_s, requested_s or self.request_timeout_s)


def default_tiers() -> list[TierSettings]:
    return [
        TierSettings(name="realtime", priority=100, window_ms=10, max_batch=4, request_timeout_s=30,
                     similarity_budget_ms=200),
        TierSettings(name="standard", priority=50, window_ms=50, max_batch=4, request_timeout_s=60),
        TierSettings(name="batch", priority=0, window_ms=1000, max_batch=8, request_timeout_s=300,
                     similarity_threshold=0.0),
    ]


class ApiKeySettings(_Strict):
    sha256: str = Field(description="Hex SHA-256 of the API key; the key itself is never stored.")
    tenant: str
    tiers: list[str] = Field(default_factory=lambda: ["standard"])
    default_tier: str | None = None
    rpm: int | None = Field(None, gt=0)
    tpm: int | None = Field(None, gt=0)

    @field_validator("sha256")
    @classmethod
    def _hex64(cls, value: str) -> str:
        value = value.lower()
        if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
            raise ValueError("must be 64 hex characters (sha256 of the key)")
        return value


class AuthSettings(_Strict):
    mode: Literal["open", "keys", "gateway"] = "open"
    keys: list[ApiKeySettings] = Field(default_factory=list)
    default_tenant: str = "default"
    gateway_secret_env: str = "MERGEBROKER_GATEWAY_SECRET"
    gateway_secret: SecretStr | None = Field(None, exclude=True)


class MergeSettings(_Strict):
    enabled: bool = True
    scope: Literal["tenant", "user", "tier", "global"] = "tenant"
    lowercase: bool = Field(True, description="Exact-duplicate keys ignore case (off for code or case-sensitive text).")
    collapse_whitespace: bool = Field(
        True, description="Exact-duplicate keys collapse whitespace runs; false only strips the ends (keeps indents).")
    cache_version: str = "1"
    header: str | None = Field(None, description="Combined-prompt header template with {n}; default built in.")
    leak_min_words: int = Field(8, ge=3)
    default_max_tokens: int = Field(256, gt=0)
    context_tokens: dict[str, int] = Field(default_factory=dict, description="Per-model context limit.")
    default_context_tokens: int = Field(8192, gt=0)
    quality_guard_ratio: float = Field(0.10, ge=0, le=1)
    quality_guard_min_batches: int = Field(20, gt=0)
    quality_guard_cooldown_s: float = Field(300.0, ge=0)
    quality_guard_min_fidelity: float = Field(
        0.8, ge=0, le=1, description="Pause merging for a tenant and model when the mean of its recent shadow "
                                     "comparisons falls below this (0: never; needs shadow_rate > 0).")
    quality_guard_fidelity_window: int = Field(20, gt=0, description="Shadow comparisons that mean is taken over.")
    shadow_rate: float = Field(0.0, ge=0, le=1, description="Share of merged members also sent alone, in the "
                                                            "background at the lowest priority, to score the merge.")
    shadow_tpm: int = Field(20_000, ge=0, description="Tokens per minute shadow calls may spend (0: none).")
    embedder: Literal["local-onnx", "local-int8", "local", "none"] = Field(
        "local-onnx", description="Similarity model: int8 all-MiniLM-L6-v2 on onnxruntime (exported once into "
                                  "embeddings.onnx_cache_dir; local-int8 if that fails), on torch, float, or none.")
    policy: Literal["cost", "always"] = Field(
        "cost", description="cost: merge, and at the size it merges, only where the merged bill is below the members' "
                            "bills alone with the provider's cache (README: When merging pays); always: as before.")
    capacity_merge: bool = Field(True, description="Under a binding rate limit, merge even at a cost premium of up to "
                                                   "capacity_max_premium (the call it saves is the scarce thing).")
    capacity_pressure: float = Field(0.9, gt=0, le=1, description="Share of the provider's or tier's RPM in use at "
                                                                  "which the rate limit counts as binding.")
    capacity_max_premium: float = Field(1.10, ge=1, description="The most a capacity merge may cost, as a multiple "
                                                                "of its members' bills alone.")


class CacheSettings(_Strict):
    enabled: bool = True
    max_entries: int = Field(10_000, gt=0)
    max_bytes: int = Field(64 * 1024 * 1024, gt=0)
    ttl_s: float = Field(3600.0, gt=0)
    jitter_ratio: float = Field(0.1, ge=0, lt=1)
    cache_nondeterministic: bool = False


class RedisSettings(_Strict):
    url: str | None = None
    share_limits: bool = True
    share_breakers: bool = True


class ClusterSettings(_Strict):
    """Cluster mode: front-ends queue chat jobs on Redis Streams, `mergebroker worker` processes merge them."""

    enabled: bool = Field(False, description="Front-ends send chat jobs to workers through Redis (needs redis.url).")
    partitions: int = Field(64, ge=1, le=4096, description="Partition streams per tier; a merge key maps to one.")
    claim_idle_ms: int = Field(5000, gt=0, description="A job idle this long in a silent (paused or cut-off) worker's "
                                                       "hands is claimed unless it went upstream; a dead worker's jobs "
                                                       "move at once.")
    lease_ms: int = Field(3000, gt=0, description="Partition lease lifetime; renewed every lease_ms / 3.")
    prefetch: int = Field(256, gt=0, description="Jobs a worker holds at once; the rest of the backlog stays in Redis.")
    block_ms: int = Field(1000, gt=0, description="Longest blocking read on the streams.")
    fallback_probe_s: float = Field(1.0, gt=0, description="How often a front-end in fallback checks for Redis.")
    failover_wait_s: float = Field(15.0, ge=0, description="How long a front-end that lost Redis keeps its sent, "
                                   "unanswered jobs waiting for Redis (a worker may have sent them upstream, and "
                                   "its note is read once Redis is back) before serving them itself; at most half "
                                   "of each job's remaining time. 0: served locally at once, at the risk of a "
                                   "second upstream call.")
    local_without_workers: bool = Field(True, description="A front-end that sees no live worker (none renewed "
                                        "within lease_ms) merges in-process until one is back, checked every "
                                        "fallback_probe_s; off: jobs wait in Redis for a worker.")
    prefix: str = Field("mb:cluster", min_length=1, description="Key prefix of every cluster stream and lease.")


class EmbeddingSettings(_Strict):
    model_threads: int = Field(
        2, ge=1, description="Threads of the local model (onnxruntime or torch). Two: on a busy host a second thread "
                             "about doubles the model's share of the CPU for the same CPU per text (README: Similarity "
                             "under load); 1 keeps it to one core.")
    onnx_cache_dir: str | None = Field(None, description="Where the similarity model's ONNX export is kept (default: "
                                                         "~/.cache/mergebroker/onnx); `python -m "
                                                         "mergebroker.providers.local.onnx_export` makes it ahead of time.")
    window_ms: float = Field(5.0, ge=0)
    max_batch_size: int = Field(64, gt=0)
    max_batch_tokens: int = Field(16_384, gt=0)
    dtype: Literal["float32", "float16"] = "float32"
    cache_version: str = "1"
    cache_scope: Literal["global", "tenant"] = Field(
        "global", description="global: one cache for everyone (a hit can tell that anyone embedded the text before); "
                              "tenant: each tenant its own entries.")
    local_models: list[str] = Field(default_factory=lambda: ["all-MiniLM-L6-v2", "local-minilm"])
    max_inputs: int = Field(2048, gt=0, description="Most inputs one /v1/embeddings request may hold (400 above).")
    max_input_tokens: int = Field(100_000, gt=0, description="Most tokens one /v1/embeddings request may hold (400 above).")


class LoggingSettings(_Strict):
    level: Literal["debug", "info", "warning", "error"] = "info"
    json_lines: bool = True
    request_lines_per_s: float | None = Field(
        100.0, ge=0, description="Most `request` lines logged per second (a burst of one second's worth); past it "
        "successful requests are sampled and counted in one `request_log_sampled` line a second, errors are always "
        "logged. null: every request; 0: errors only. The ledger and /metrics count every request either way.")


class LedgerSettings(_Strict):
    path: str | None = Field(None, description="SQLite file for the usage ledger; off when unset.")
    postgres_dsn_env: str | None = Field(None, description="Environment variable holding a PostgreSQL DSN.")
    postgres_dsn: SecretStr | None = Field(None, exclude=True)
    flush_interval_s: float = Field(1.0, gt=0)


class ResponsesSettings(_Strict):
    """`/v1/responses`: where stored responses are kept, and for how long."""

    backend: Literal["auto", "sqlite", "redis"] = Field(
        "auto", description="Where stored responses live: redis (shared by replicas; needs redis.url), sqlite, or "
                            "auto (redis in cluster mode, else sqlite).")
    store_path: str | None = Field(None, description="SQLite file of stored responses; in memory when unset.")
    retention_s: float = Field(30 * 86400, gt=0, description="Stored responses older than this are removed.")


class McpSettings(_Strict):
    """`mergebroker mcp`: how the MCP server listens and where its tools send their calls."""

    transport: Literal["stdio", "http"] = Field("stdio", description="stdio, or streamable HTTP on host:port.")
    host: str = "127.0.0.1"
    port: int = Field(8090, ge=0, le=65535)
    broker_url: str | None = Field(None, description="A running broker to call; unset: the broker runs embedded.")
    api_key_env: str = Field("MERGEBROKER_API_KEY", description="Environment variable with the key the tools use.")
    embedding_model: str = Field("all-MiniLM-L6-v2", description="The embed tool's model when a call names none.")
    max_inline_values: int = Field(16_384, gt=0, description="embed: past this many floats, a handle instead.")
    max_handles: int = Field(32, gt=0, description="embed: how many large results stay readable by handle.")
    max_handle_bytes: int = Field(256 * 1024 * 1024, gt=0, description="embed: bytes of vectors all handles keep.")
    http_token_env: str = Field("MERGEBROKER_MCP_TOKEN", description="Environment variable with the bearer token "
                                                                     "the HTTP transport asks of every caller.")


class BatchSettings(_Strict):
    enabled: bool = True
    dir: str | None = Field(None, description="Files and batch state (SQLite); default: 'batches' beside "
                                              "ledger.path, else a temporary directory (not durable).")
    tier: str | None = Field(None, description="Tier whose merge rules and admission bulk jobs follow; "
                                               "default: 'batch' when configured, else default_tier.")
    max_file_bytes: int = Field(200 * 1024 * 1024, gt=0)
    max_lines: int = Field(50_000, gt=0)
    max_uploads_per_tenant: int = Field(4, gt=0, description="Uploads one tenant may stream at once (429 past it).")
    max_form_parts: int = Field(8, ge=2, description="Parts an upload's form may hold (OpenAI's: purpose, file).")
    file_ttl_s: float = Field(30 * 86400.0, gt=0, description="Uploaded and output files expire after this.")
    concurrency: int = Field(8, gt=0, description="Bulk calls in flight through the pools, all jobs together.")
    call_timeout_s: float = Field(600.0, gt=0)
    poll_interval_s: float = Field(30.0, gt=0, description="How often a provider's Batch API is polled.")
    cleanup_interval_s: float = Field(3600.0, gt=0)


class Settings(BaseSettings):
    """Everything configurable; build it with `load_settings`, which layers its sources (see the module doc)."""

    model_config = SettingsConfigDict(env_prefix="MERGEBROKER_", env_nested_delimiter="__", extra="forbid")

    server: ServerSettings = Field(default_factory=ServerSettings)
    providers: list[ProviderSettings] = Field(default_factory=list)
    routing: Literal["least_in_flight", "round_robin"] = "least_in_flight"
    retry: RetrySettings = Field(default_factory=RetrySettings)
    tiers: list[TierSettings] = Field(default_factory=default_tiers)
    default_tier: str = "standard"
    auth: AuthSettings = Field(default_factory=AuthSettings)
    merge: MergeSettings = Field(default_factory=MergeSettings)
    cache: CacheSettings = Field(default_factory=CacheSettings)
    redis: RedisSettings = Field(default_factory=RedisSettings)
    embeddings: EmbeddingSettings = Field(default_factory=EmbeddingSettings)
    logging: LoggingSettings = Field(default_factory=LoggingSettings)
    ledger: LedgerSettings = Field(default_factory=LedgerSettings)
    responses: ResponsesSettings = Field(default_factory=ResponsesSettings)
    batches: BatchSettings = Field(default_factory=BatchSettings)
    cluster: ClusterSettings = Field(default_factory=ClusterSettings)
    mcp: McpSettings = Field(default_factory=McpSettings)
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    pricing: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="USD per million tokens by model: {input, cached_input, output, and "
                                          "optionally cache_write, context_window, max_output_tokens, cache}; over "
                                          "the shipped table (merge/default_prices.py).")
    pricing_file: str | None = Field(None, description="A price file in LiteLLM's model_prices_and_context_window.json "
                                                       "format, between the shipped table and `pricing`.")

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource) -> tuple:
        # `load_settings` layers file, environment and overrides itself, so that overrides can win.
        return (init_settings,)

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError("tiers: tier names must be unique")
        if self.default_tier not in names:
            raise ValueError(f"default_tier: {self.default_tier!r} is not a configured tier")
        for key in self.auth.keys:
            for tier in key.tiers + ([key.default_tier] if key.default_tier else []):
                if tier not in names:
                    raise ValueError(f"auth.keys: tier {tier!r} of tenant {key.tenant!r} is not configured")
        provider_names = [p.name for p in self.providers]
        if len(set(provider_names)) != len(provider_names):
            raise ValueError("providers: provider names must be unique")
        for p in self.providers:
            if p.kind in HTTP_PROVIDER_KINDS and not p.base_url.startswith(("http://", "https://")):
                raise ValueError(f"providers.{p.name}.base_url: must be an http(s) URL, got {p.base_url!r}")
        if self.responses.backend == "redis" and not self.redis.url:
            raise ValueError("responses.backend: redis needs redis.url")
        if self.batches.tier is not None and self.batches.tier not in names:
            raise ValueError(f"batches.tier: {self.batches.tier!r} is not a configured tier")
        if self.cluster.enabled and not self.redis.url:
            raise ValueError("cluster.enabled: cluster mode needs redis.url")
        if self.auth.mode == "keys" and not self.auth.keys:
            raise ValueError("auth.keys: mode 'keys' needs at least one key")
        try:  # a bad price entry or file is refused at start-up, by name
            self.price_table()
        except OSError as exc:
            raise ValueError(f"pricing_file: cannot read {self.pricing_file}: {exc.strerror}") from exc
        except json.JSONDecodeError as exc:
            raise ValueError(f"pricing_file: {self.pricing_file} is not JSON ({exc})") from exc
        return self

    def price_table(self) -> PriceTable:
        """The prices in force: the shipped table, under the LiteLLM file (if any), under `pricing`."""
        return PriceTable.build(self.pricing, litellm_path=self.pricing_file)

    def batch_tier(self) -> str:
        """The tier bulk jobs run in: `batches.tier`, else 'batch' when configured, else the default tier."""
        names = [t.name for t in self.tiers]
        return self.batches.tier or ("batch" if "batch" in names else self.default_tier)

    def tier(self, name: str) -> TierSettings:
        return next(t for t in self.tiers if t.name == name)
