#!/usr/bin/env bash
# Checks the layer contracts in .importlinter (lint-imports).
# grimp finds the layers by walking the `mergebroker` package's folder, `core/`; the links core/broker,
# core/merge, core/breaker and core/providers point at the repository's top-level folders, so it sees them
# under the names they are installed with. (The wheel is built from the package-dir mapping, not the links.)
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/lint-imports --no-cache
