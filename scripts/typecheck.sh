#!/usr/bin/env bash
# Type-checks the installed package, `mergebroker.*`, with mypy (settings in pyproject.toml [tool.mypy]).
# mypy cannot follow the editable install's import hook, so this lays the repository's folders out as the
# wheel does (setup.py's LAYERS: core/ is `mergebroker`, merge/ is `mergebroker.merge`, ...) in a tree of
# links under .mypy_cache/, checks that, and reports each error at its path in the repository.
# Usage: scripts/typecheck.sh [mypy options...]
set -euo pipefail
cd "$(dirname "$0")/.."
tree=.mypy_cache/mergebroker-tree
rm -rf "$tree"
mkdir -p "$tree"
# Prints one `sed` substitution per layer, mapping tree paths back to repository paths (deepest layer first).
subs=$(.venv/bin/python - "$tree" <<'PY'
import ast, os, sys, tomllib
tree = sys.argv[1]
setup = ast.parse(open("setup.py").read())
layers = next(ast.literal_eval(n.value) for n in ast.walk(setup)
              if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "LAYERS")
for name, folder in sorted(layers.items(), key=lambda kv: -kv[0].count(".")):
    path = os.path.join(tree, *name.split("."))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if name == "mergebroker":  # the root package's folder also holds the layers' links: link its entries
        os.makedirs(path, exist_ok=True)
        for entry in os.listdir(folder):
            if entry != "__pycache__":
                os.symlink(os.path.abspath(os.path.join(folder, entry)), os.path.join(path, entry))
    else:
        os.symlink(os.path.abspath(folder), path)
    print(f"-e s#^{path}/#{folder}/#")
# The ground's modules are listed one by one in the strict override: a new one must not slip out of it.
strict = {m for o in tomllib.load(open("pyproject.toml", "rb"))["tool"]["mypy"]["overrides"]
          if o.get("disallow_untyped_defs") for m in o["module"]}
missing = sorted(f"mergebroker.{f[:-3]}" for f in os.listdir(layers["mergebroker"])
                 if f.endswith(".py") and f != "__init__.py" and f"mergebroker.{f[:-3]}" not in strict)
if missing:
    sys.exit(f"pyproject.toml: add {', '.join(missing)} to the strict [[tool.mypy.overrides]]")
PY
)
.venv/bin/mypy "$@" 2>&1 | sed $subs  # pipefail: the script fails when mypy does
