#!/usr/bin/env bash
# Checks the layer contracts in .importlinter (lint-imports) on a real tree: the package as `pip install .`
# builds it (the wheel, unpacked), so what is checked is what ships. Custom contract types live in
# scripts/contracts/.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
rm -rf build  # setuptools keeps stale modules in build/lib and would ship them
.venv/bin/pip wheel -q --no-deps --no-build-isolation -w "$tmp/wheel" . >"$tmp/build.log" 2>&1 ||
  { cat "$tmp/build.log"; exit 1; }
.venv/bin/python -m zipfile -e "$tmp"/wheel/*.whl "$tmp/tree"
cd "$tmp/tree"
PYTHONPATH="$tmp/tree:$OLDPWD/scripts/contracts" exec "$OLDPWD/.venv/bin/lint-imports" --no-cache \
  --config "$OLDPWD/.importlinter"
