#!/usr/bin/env bash
# Installs what the tests need (venv, CPU torch, the package, redis-server) and runs the test suite.
# Usage: scripts/test.sh [pytest options...]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --with-redis
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/python -m pytest "$@"
