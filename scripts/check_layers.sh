#!/usr/bin/env bash
# Checks the layer contracts in .importlinter (lint-imports) against the installed layout.
# grimp walks a package's own folder, and the repository spreads `mergebroker.*` over several top-level
# folders, so the check runs on a staged copy laid out as the wheel installs it.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir "$stage/mergebroker"
cp core/*.py "$stage/mergebroker/"
for layer in broker merge breaker providers; do
  cp -r "$layer" "$stage/mergebroker/$layer"
done
cd "$stage"
PYTHONPATH="$stage" "$repo/.venv/bin/lint-imports" --no-cache "$repo/.importlinter"
