"""Tool calling between OpenAI's and Anthropic's shapes, both ways (pure).

Requests: function `tools` become Anthropic tools (`parameters` as `input_schema`, `strict` kept);
`tool_choice` `auto`/`none`/`required`/a named function becomes `auto`/`none`/`any`/`tool`, and
`parallel_tool_calls: false` becomes `disable_parallel_tool_use`; an assistant's `tool_calls` become
`tool_use` blocks (arguments parsed: Anthropic takes the input as an object). Replies: `tool_use` blocks
become `tool_calls` with the input as a JSON string, as OpenAI clients parse them.
"""

from __future__ import annotations

import json
from typing import Any

from mergebroker.providers.anthropic.refuse import refuse

_OPEN_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}
_CHOICES = {"auto": "auto", "none": "none", "required": "any"}


def to_tools(tools: Any) -> list[dict[str, Any]]:
    """Anthropic tools for OpenAI's `tools` (function tools only)."""
    if not isinstance(tools, list):
        raise refuse("tools", "tools must be a list of function tools")
    out = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise refuse(f"tools[{i}].type", "only function tools are translated")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise refuse(f"tools[{i}].function.name", "a function tool needs a name")
        schema = function.get("parameters")
        if schema is None:
            schema = _OPEN_OBJECT
        elif not isinstance(schema, dict) or schema.get("type", "object") != "object":
            raise refuse(f"tools[{i}].function.parameters", "Anthropic takes a tool's input as a JSON object, "
                                                            "so its schema must describe an object")
        converted: dict[str, Any] = {"name": function["name"], "input_schema": {"type": "object", **schema}}
        if isinstance(function.get("description"), str) and function["description"]:
            converted["description"] = function["description"]
        if isinstance(function.get("strict"), bool):
            converted["strict"] = function["strict"]
        out.append(converted)
    return out


def to_tool_choice(choice: Any, *, parallel: Any, has_tools: bool) -> dict[str, Any] | None:
    """Anthropic's `tool_choice` for OpenAI's `tool_choice` and `parallel_tool_calls` (None: leave it out)."""
    if not has_tools:
        if choice in (None, "auto", "none"):
            return None  # asks nothing of a request without tools
        raise refuse("tool_choice", "it names a tool, but the request has no tools")
    if choice is None:
        out: dict[str, Any] = {"type": "auto"}
    elif isinstance(choice, str) and choice in _CHOICES:
        out = {"type": _CHOICES[choice]}
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
            and isinstance(choice["function"].get("name"), str):
        out = {"type": "tool", "name": choice["function"]["name"]}
    else:
        raise refuse("tool_choice", "only auto, none, required and a named function are translated")
    if parallel is False and out["type"] != "none":
        out["disable_parallel_tool_use"] = True
    elif choice is None:
        return None  # Anthropic's default is auto too
    return out


def tool_use_blocks(calls: Any, where: str) -> list[dict[str, Any]]:
    """`tool_use` blocks for an assistant message's `tool_calls` at `where`."""
    if not isinstance(calls, list):
        raise refuse(where, "tool_calls must be a list")
    blocks = []
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or call.get("type", "function") != "function" or not isinstance(function, dict):
            raise refuse(f"{where}[{k}].type", "only function calls are translated")
        if not isinstance(call.get("id"), str) or not isinstance(function.get("name"), str):
            raise refuse(f"{where}[{k}]", "a tool call needs an id and a function name")
        blocks.append({"type": "tool_use", "id": call["id"], "name": function["name"],
                       "input": _arguments(function.get("arguments"), f"{where}[{k}].function.arguments")})
    return blocks


def _arguments(arguments: Any, where: str) -> dict[str, Any]:
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return {}
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else None
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise refuse(where, "Anthropic takes a tool call's arguments as a JSON object")
    return value


def to_tool_calls(blocks: list[Any], *, skip: str | None = None) -> list[dict[str, Any]]:
    """OpenAI `tool_calls` for the `tool_use` blocks of a reply (but the tool named `skip`)."""
    return [{"id": str(b.get("id") or ""), "type": "function",
             "function": {"name": str(b.get("name") or ""), "arguments": arguments_json(b.get("input"))}}
            for b in blocks if isinstance(b, dict) and b.get("type") == "tool_use" and b.get("name") != skip]


def arguments_json(value: Any) -> str:
    """A tool's input as the JSON string OpenAI clients parse (compact, as OpenAI sends it)."""
    return json.dumps(value if value is not None else {}, separators=(",", ":"), ensure_ascii=False)
