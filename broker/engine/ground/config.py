"""Loading the configuration: one YAML file, `MERGEBROKER_*` environment overrides (`__` for nesting) and
CLI overrides, into one `Settings`.

Precedence, highest first: overrides given to `load_settings` (the command line's flags), the
environment, the YAML file, the defaults; nested sections merge key by key, lists are replaced whole.
This is the only module that reads the environment. Provider API keys, the gateway secret and the
PostgreSQL DSN come from the environment only (their variable names are configured); one written into
the YAML file is refused at start-up.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import SecretStr, ValidationError
from pydantic_settings import EnvSettingsSource

from mergebroker.broker.engine.ground.settings import Settings


class ConfigError(Exception):
    """Invalid configuration; the message names the field and the problem."""


SECRET_FIELDS = ("api_key", "gateway_secret", "postgres_dsn", "metrics_token")


def load_settings(path: str | os.PathLike[str] | None = None, *, environ: dict[str, str] | None = None,
                  overrides: dict[str, Any] | None = None) -> Settings:
    """Build Settings from a YAML file (or `MERGEBROKER_CONFIG`), the environment and CLI overrides.

    `overrides` win over the `MERGEBROKER_*` variables, which win over the file. `environ` is where the
    config path and the secrets are read (default `os.environ`); the `MERGEBROKER_*` overrides always
    come from the process environment.
    """
    env = os.environ if environ is None else environ
    path = path or env.get("MERGEBROKER_CONFIG")
    data: dict[str, Any] = _read_yaml(Path(path)) if path else {}
    _refuse_secrets_in_file(data)
    data = _deep_merge(data, EnvSettingsSource(Settings)())
    data = _deep_merge(data, overrides or {})
    try:
        settings = Settings(**data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from exc
    _resolve_secrets(settings, env)
    settings.telemetry = settings.telemetry.resolved(env)  # OTEL_* switch telemetry on where the file leaves it open
    return settings


def settings_for_command(path: str | os.PathLike[str] | None, *,
                         overrides: dict[str, Any] | None = None) -> Settings | None:
    """`load_settings` for a CLI command: None (after saying why on stderr) when the configuration is invalid,
    so every command exits 2 with the same message."""
    try:
        return load_settings(path, overrides=overrides)
    except ConfigError as exc:
        print(f"mergebroker: {exc}", file=sys.stderr)
        return None


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`base` with `top` laid over it: mappings merge key by key, anything else (lists too) is replaced."""
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path}: not valid YAML ({exc})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: the top level must be a mapping")
    return data


def _refuse_secrets_in_file(data: dict[str, Any]) -> None:
    for i, provider in enumerate(data.get("providers") or []):
        if isinstance(provider, dict) and "api_key" in provider:
            raise ConfigError(f"providers.{i}.api_key: secrets may only come from the environment; "
                              "set api_key_env to the name of an environment variable instead")
    if isinstance(data.get("auth"), dict) and "gateway_secret" in data["auth"]:
        raise ConfigError("auth.gateway_secret: secrets may only come from the environment; "
                          "set auth.gateway_secret_env instead")
    if isinstance(data.get("server"), dict) and "metrics_token" in data["server"]:
        raise ConfigError("server.metrics_token: secrets may only come from the environment; "
                          "set server.metrics_token_env instead")
    if isinstance(data.get("ledger"), dict) and "postgres_dsn" in data["ledger"]:
        raise ConfigError("ledger.postgres_dsn: secrets may only come from the environment (a DSN holds a "
                          "password); set ledger.postgres_dsn_env instead")


def _resolve_secrets(settings: Settings, env: dict[str, str] | os._Environ[str]) -> None:
    for provider in settings.providers:
        if provider.api_key_env and env.get(provider.api_key_env):
            provider.api_key = SecretStr(env[provider.api_key_env])
    if settings.ledger.postgres_dsn_env and env.get(settings.ledger.postgres_dsn_env):
        settings.ledger.postgres_dsn = SecretStr(env[settings.ledger.postgres_dsn_env])
    token_env = settings.server.metrics_token_env
    if token_env:
        if not env.get(token_env):
            raise ConfigError(f"server.metrics_token_env: ${token_env} is not set")
        settings.server.metrics_token = SecretStr(env[token_env])
    secret = env.get(settings.auth.gateway_secret_env)
    if secret:
        settings.auth.gateway_secret = SecretStr(secret)
    if settings.auth.mode == "gateway" and settings.auth.gateway_secret is None:
        raise ConfigError(f"auth.gateway_secret_env: mode 'gateway' needs the shared secret in "
                          f"${settings.auth.gateway_secret_env}")


def _describe(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        field = ".".join(str(part) for part in err["loc"]) or "config"
        lines.append(f"{field}: {err['msg']}")
    return "invalid configuration:\n  " + "\n  ".join(lines)
