"""Settings come from one YAML file plus MERGEBROKER_ environment overrides; bad config stops start-up."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mergebroker.broker.cli import build_parser, serve_overrides
from mergebroker.broker.engine.ground.config import ConfigError, load_settings
from tests.helpers.paths import REPO

ROOT = REPO


def test_the_example_config_loads():
    settings = load_settings(ROOT / "configs" / "mergebroker.example.yaml", environ={})
    assert [t.name for t in settings.tiers] == ["realtime", "standard", "batch"]
    assert settings.auth.mode == "keys"


def test_environment_overrides_the_file_with_double_underscore_nesting(tmp_path, monkeypatch):
    path = tmp_path / "c.yaml"
    path.write_text("server:\n  port: 9000\n  host: 0.0.0.0\n")
    monkeypatch.setenv("MERGEBROKER_SERVER__PORT", "9100")
    settings = load_settings(path)
    assert settings.server.port == 9100 and settings.server.host == "0.0.0.0"


def test_config_path_from_environment(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("default_tier: batch\n")
    assert load_settings(None, environ={"MERGEBROKER_CONFIG": str(path)}).default_tier == "batch"


@pytest.mark.parametrize("text,field", [
    ("tiers:\n  - name: a\n    max_batch: 20\ndefault_tier: a\n", "tiers.0.max_batch"),
    ("server:\n  port: abc\n", "server.port"),
    ("default_tier: nope\n", "default_tier"),
    ("providers:\n  - name: p\n    base_url: ftp://x\n", "base_url"),
    ("providers:\n  - name: p\n    base_url: http://x\n    api_key: sk-1\n", "providers.0.api_key"),
    ("ledger:\n  postgres_dsn: postgresql://u:pw@db/x\n", "ledger.postgres_dsn"),
    ("surprise: 1\n", "surprise"),
    ("auth:\n  mode: keys\n", "auth.keys"),
])
def test_invalid_config_names_the_field(tmp_path, text, field):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_settings(path, environ={})
    assert field in str(info.value)


def test_serve_exits_2_with_the_field_on_invalid_config(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("tiers:\n  - name: a\n    window_ms: -5\ndefault_tier: a\n")
    result = subprocess.run([sys.executable, "-m", "mergebroker.broker.cli", "serve", "--config", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "tiers.0.window_ms" in result.stderr


@pytest.mark.parametrize("command", ["serve", "simulate", "report", "warm-cache", "bench"])
def test_every_command_has_useful_help(command):
    result = subprocess.run([sys.executable, "-m", "mergebroker.broker.cli", command, "--help"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0
    assert "usage: mergebroker " + command in result.stdout


def test_command_line_flags_win_over_environment_and_file(tmp_path, monkeypatch):
    path = tmp_path / "c.yaml"
    path.write_text("server:\n  port: 9000\n  host: 0.0.0.0\nmerge:\n  scope: user\n")
    monkeypatch.setenv("MERGEBROKER_SERVER__PORT", "9100")
    monkeypatch.setenv("MERGEBROKER_SERVER__HOST", "10.0.0.1")
    args = build_parser().parse_args(["serve", "--config", str(path), "--port", "9300"])
    settings = load_settings(args.config, overrides=serve_overrides(args))
    assert settings.server.port == 9300
    assert settings.server.host == "10.0.0.1"  # no --host: the environment still wins over the file
    assert settings.merge.scope == "user"


def test_overrides_merge_into_file_sections_instead_of_replacing_them(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("merge:\n  scope: user\n  lowercase: false\n")
    settings = load_settings(path, environ={}, overrides={"merge": {"collapse_whitespace": False}})
    merge = settings.merge
    assert (merge.scope, merge.lowercase, merge.collapse_whitespace) == ("user", False, False)


def test_postgres_dsn_is_read_from_the_named_environment_variable(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("ledger:\n  postgres_dsn_env: PG_DSN\n")
    settings = load_settings(path, environ={"PG_DSN": "postgresql://u:pw@db/x"})
    assert settings.ledger.postgres_dsn.get_secret_value() == "postgresql://u:pw@db/x"


@pytest.mark.parametrize("provider, field", [
    ({"name": "a", "kind": "anthropic", "base_url": "api.example.com"}, "base_url"),
    ({"name": "z", "kind": "azure", "base_url": ""}, "base_url"),
    ({"name": "o", "base_url": "http://x/v1", "deployments": {"m": "d"}}, "deployments"),
    ({"name": "z", "kind": "azure", "base_url": "https://r.example.com", "model_map": {"m": "n"}}, "model_map"),
])
def test_provider_kinds_check_their_own_keys(provider, field):
    with pytest.raises(ConfigError, match=field):
        load_settings(None, environ={}, overrides={"providers": [provider]})


def test_provider_kind_keys_have_defaults_and_keys_come_from_the_environment():
    providers = [{"name": "a", "kind": "anthropic", "base_url": "https://api.example.com", "api_key_env": "AK"},
                 {"name": "z", "kind": "azure", "base_url": "https://r.example.com", "api_key_env": "ZK"}]
    settings = load_settings(None, environ={"AK": "ant", "ZK": "az"}, overrides={"providers": providers})
    anthropic, azure = settings.providers
    assert anthropic.anthropic_version == "2023-06-01" and azure.api_version == "2024-10-21"
    assert anthropic.api_key.get_secret_value() == "ant" and azure.api_key.get_secret_value() == "az"
