#!/usr/bin/env bash
# Installs everything mergebroker needs into .venv (CPU torch first), once per pyproject change.
# Usage: scripts/setup.sh [--with-redis]   (--with-redis also installs redis-server for the tests)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ "${1:-}" = "--with-redis" ] && ! command -v redis-server >/dev/null 2>&1; then
  echo "==> installing redis-server (Debian package)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv"
  "$PYTHON" -m venv .venv
fi
stamp=".venv/.mergebroker-$(cat pyproject.toml | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "==> installing torch (CPU build) and mergebroker with its dev tools"
  .venv/bin/pip install -q --upgrade pip
  # torch first and pinned: an unpinned torch would pull a multi-GB GPU build.
  .venv/bin/pip install -q torch==2.13.0
  .venv/bin/pip install -q -e ".[dev,bench,mcp]"
  rm -f .venv/.mergebroker-*
  touch "$stamp"
fi
