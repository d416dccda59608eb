"""How to run the real agent clients (Codex CLI, Claude Code) non-interactively against a broker on loopback.

Each builder returns an `AgentRun`: argv, a clean environment (nothing inherited but PATH, so no real keys,
proxies or user config leak in) and the working directory. `home` is a throwaway folder that becomes HOME and the
client's config directory, so a run never reads or writes the real user's ~/.codex or ~/.claude.
Findings behind every flag: bench/agents/README.md.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOCAL_BIN = ROOT / ".agents" / "node_modules" / ".bin"  # where scripts/agent_clients.sh installs them
API_KEY = "mb-agent-test-key"  # the broker does not check it; the clients refuse to start without one


@dataclass(frozen=True)
class AgentRun:
    """One client invocation: run `argv` in `cwd` with exactly `env`."""

    argv: list[str]
    cwd: str
    env: dict[str, str] = field(default_factory=dict)


def find_client(name: str) -> str | None:
    """The path of the `codex` or `claude` binary: the project-local install first, then PATH; None if absent."""
    local = LOCAL_BIN / name
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which(name)


def _base_env(home: Path) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8",
            "NO_COLOR": "1", "TERM": "dumb"}


def codex_run(binary: str, *, base_url: str, model: str, prompt: str, workdir: Path, home: Path,
              provider: str = "mergebroker") -> AgentRun:
    """`codex exec` with a custom Responses-API provider at `base_url` (the broker's /v1), no login, no
    approvals, no sandbox (the test's temporary folder is the sandbox), no retries (a failure shows at once)."""
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    overrides = {
        "model_provider": provider,
        f"model_providers.{provider}.name": provider,
        f"model_providers.{provider}.base_url": base_url,
        f"model_providers.{provider}.wire_api": "responses",
        f"model_providers.{provider}.env_key": "MERGEBROKER_AGENT_KEY",
        f"model_providers.{provider}.request_max_retries": 0,
        f"model_providers.{provider}.stream_max_retries": 0,
        "analytics.enabled": False,
    }
    argv = [binary, "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", "--ephemeral",
            "--color", "never", "-C", str(workdir), "-m", model]
    for key, value in overrides.items():
        argv += ["-c", f"{key}={_toml(value)}"]
    env = {**_base_env(home), "CODEX_HOME": str(codex_home), "MERGEBROKER_AGENT_KEY": API_KEY}
    return AgentRun(argv + [prompt], str(workdir), env)


def claude_run(binary: str, *, base_url: str, model: str, prompt: str, workdir: Path, home: Path) -> AgentRun:
    """`claude -p` against `base_url` (the broker's root, without /v1), allowed to run Bash without asking.

    `--allowedTools Bash` works as root too; `--dangerously-skip-permissions` needs IS_SANDBOX=1 as root."""
    config_dir = home / ".claude"
    config_dir.mkdir(parents=True, exist_ok=True)
    env = {**_base_env(home), "CLAUDE_CONFIG_DIR": str(config_dir), "ANTHROPIC_BASE_URL": base_url,
           "ANTHROPIC_API_KEY": API_KEY, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
           "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1"}
    argv = [binary, "-p", prompt, "--model", model, "--allowedTools", "Bash", "--output-format", "text"]
    return AgentRun(argv, str(workdir), env)


def _toml(value: object) -> str:
    """A `-c key=value` value as TOML: strings quoted, booleans lower-case."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
