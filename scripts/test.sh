#!/usr/bin/env bash
# Installs what the tests need (venv, CPU torch, the package, redis-server) and runs the test suite.
# Usage: scripts/test.sh [pytest options...]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --with-redis
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# The real agent clients (Codex CLI, Claude Code) for tests/system/test_real_agents.py; without node or the registry
# those tests skip, saying why.
if command -v npm >/dev/null; then
  scripts/agent_clients.sh >/dev/null || echo "agent clients not installed: tests/system/test_real_agents.py will skip" >&2
fi
# The architecture cannot drift silently: layer contracts, and no bare-name imports of the repository folders.
scripts/check_layers.sh >/dev/null || { scripts/check_layers.sh; exit 1; }
# Lint (rule set in pyproject.toml, the banned bare-name imports among it) and types (strict on core/, merge/
# and breaker/).
.venv/bin/ruff check --quiet .
scripts/typecheck.sh >/dev/null || { scripts/typecheck.sh; exit 1; }
exec .venv/bin/python -m pytest "$@"
