#!/usr/bin/env bash
# Installs the real agent clients (Codex CLI, Claude Code) into .agents/ for tests/system/test_real_agents.py, once per pin.
# Usage: scripts/agent_clients.sh        prints the two binaries' paths (codex first, then claude)
# Needs node >= 18 and npm. Both packages ship native binaries (platform packages pulled as optional dependencies);
# after this install neither needs the network to start.
set -euo pipefail
cd "$(dirname "$0")/.."

CODEX_VERSION=0.171.0
CLAUDE_CODE_VERSION=2.1.332
prefix=.agents

mkdir -p "$prefix"
# The folder ignores itself, so the checkout stays clean even where .gitignore does not name it.
[ -f "$prefix/.gitignore" ] || echo '*' > "$prefix/.gitignore"

installed_version() {  # prints the version of an installed package, or nothing
  node -e 'try{console.log(require(process.argv[1]).version)}catch(e){}' "$PWD/$prefix/node_modules/$1/package.json"
}

if [ "$(installed_version @openai/codex)" != "$CODEX_VERSION" ] ||
   [ "$(installed_version @anthropic-ai/claude-code)" != "$CLAUDE_CODE_VERSION" ]; then
  echo "==> installing @openai/codex@$CODEX_VERSION and @anthropic-ai/claude-code@$CLAUDE_CODE_VERSION into $prefix/" >&2
  npm install --prefix "$prefix" --no-audit --no-fund --no-save --loglevel=error \
    "@openai/codex@$CODEX_VERSION" "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION" >/dev/null
fi

for bin in codex claude; do
  path="$PWD/$prefix/node_modules/.bin/$bin"
  "$path" --version >/dev/null  # fails loudly when the native binary for this platform is missing
  echo "$path"
done
