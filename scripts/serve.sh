#!/usr/bin/env bash
# Starts the broker. With no config and no --upstream it serves from the built-in simulated upstream.
# Usage: scripts/serve.sh [mergebroker serve options...]   e.g. --port 8080 --upstream https://host/v1
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/mergebroker serve "$@"
