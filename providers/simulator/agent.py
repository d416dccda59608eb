"""The simulated model as an agent's model (pure): which tools it calls, with what input, what it says once the
tools have answered, and JSON that follows a schema. Protocol-neutral, so any of the simulator's modes (and a
test's own upstream) can answer tool and structured-output requests the same way.

- Given tools it may use and no tool results yet, it calls them: the named one when the choice names
  one, else every tool (all at once, unless parallel calls are off: then the first only). An agent's tool set
  (one with a shell tool: Claude Code's `Bash`, Codex CLI's `exec_command`, `shell`, `shell_command`) gets the
  shell tool alone, with its required inputs only and as the command the last one the question quotes between
  backticks (else a harmless `echo`), so that a real agent runs it (all of its tools at once would write
  files and spawn sub-agents).
- Once the last user turn holds tool results, it answers in text, quoting them (`after_tools`).
- Inputs and structured answers are `instance(schema, seed)`: a deterministic value of the schema's
  shape (objects with every property, `$ref`s into `$defs` followed, enums and consts honoured).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

_LETTERS = "ghijklmnopqrstuvwxyz"  # letters only: a value never reads as a batch ID (a letter and digits)
_MAX_DEPTH = 8


def tool_calls(tools: Sequence[Mapping[str, Any]], choice: str, *, named: str | None = None, parallel: bool = True,
               seed: str) -> list[tuple[str, dict[str, Any]]]:
    """(name, input) of each tool the model calls. `tools` are (name, input schema) mappings with keys `name`
    and `schema`; `choice` is `none`, `auto`, `any` or `tool` (then `named` is the tool)."""
    if choice == "none":
        return []
    chosen = [t for t in tools if t["name"] == named] if choice == "tool" else list(tools)
    shell = next((t for t in chosen if t["name"] in SHELL_TOOLS), None)
    if shell is not None:
        return [(shell["name"], shell_input(shell.get("schema") or {}, seed))]
    if not parallel:
        chosen = chosen[:1]
    return [(t["name"], _as_object(instance(t.get("schema") or {}, f"{seed}\0{t['name']}"))) for t in chosen]


SHELL_TOOLS = frozenset({"Bash", "bash", "shell", "local_shell", "shell_command", "exec_command"})
"""The names agents give the tool that runs a command line (Claude Code, Codex CLI)."""
_COMMAND_KEYS = ("command", "cmd")
_QUOTED_COMMAND = re.compile(r"`([^`\n]+)`")


def shell_input(schema: Mapping[str, Any], question: str) -> dict[str, Any]:
    """A shell tool's input: its required properties (a model leaves optional timeouts and flags alone), the
    command the last one `question` quotes between backticks (else an `echo` of a word seeded by it), as a string
    or as an argv (`["bash", "-lc", ...]`) as the schema says."""
    seed = f"{question}\0shell"
    properties = schema.get("properties") or {}
    wanted = ([k for k in schema.get("required") or [] if k in properties]
              or [k for k in _COMMAND_KEYS if k in properties][:1])
    value = {name: instance(properties[name], f"{seed}.{name}", root=schema) for name in wanted}
    quoted = _QUOTED_COMMAND.findall(question)
    line = quoted[-1].strip() if quoted else "echo " + _scalar("string", {}, seed)
    for key in _COMMAND_KEYS:
        if key in value:
            value[key] = ["bash", "-lc", line] if (properties[key] or {}).get("type") == "array" else line
    return value


def after_tools(results: Sequence[str]) -> str:
    """The answer once the tools have answered: their results, quoted in order."""
    return "From the tools: " + "; ".join(r.strip() or "(empty)" for r in results) + "."


def instance(schema: Any, seed: str, *, root: Any = None, depth: int = 0) -> Any:
    """A deterministic value of `schema`'s shape, varied by `seed`."""
    root = schema if root is None else root
    if not isinstance(schema, Mapping) or depth > _MAX_DEPTH:
        return None
    if "$ref" in schema:
        return instance(_resolve(root, schema["$ref"]), seed, root=root, depth=depth + 1)
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][_number(seed) % len(schema["enum"])]
    for key in ("anyOf", "oneOf", "allOf"):
        options = [o for o in schema.get(key) or [] if isinstance(o, Mapping) and o.get("type") != "null"]
        if options:
            return instance(options[0], seed, root=root, depth=depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind == "object" or (kind is None and "properties" in schema):
        properties = schema.get("properties") or {}
        return {name: instance(sub, f"{seed}.{name}", root=root, depth=depth + 1) for name, sub in properties.items()}
    if kind == "array":
        count = max(1, int(schema.get("minItems") or 0))
        return [instance(schema.get("items") or {}, f"{seed}[{i}]", root=root, depth=depth + 1) for i in range(count)]
    return _scalar(kind, schema, seed)


def _scalar(kind: Any, schema: Mapping[str, Any], seed: str) -> Any:
    low = schema.get("minimum", 0)
    if kind == "integer":
        return int(low) + _number(seed) % 100
    if kind == "number":
        return float(low) + (_number(seed) % 1000) / 10
    if kind == "boolean":
        return _number(seed) % 2 == 0
    if kind == "null":
        return None
    return "".join(_LETTERS[b % len(_LETTERS)] for b in hashlib.sha256(seed.encode()).digest()[:8])


def _number(seed: str) -> int:
    return int.from_bytes(hashlib.sha256(seed.encode()).digest()[:4], "big")


def _resolve(root: Any, ref: Any) -> Any:
    """The schema a local `$ref` ("#/$defs/Name") points at, or an empty schema."""
    node = root
    for part in str(ref).removeprefix("#/").split("/") if str(ref).startswith("#/") else []:
        node = node.get(part) if isinstance(node, Mapping) else None
    return node if isinstance(node, Mapping) else {}


def _as_object(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}
