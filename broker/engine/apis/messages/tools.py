"""A Messages request's `tools` and `tool_choice`: checked, and turned into Chat Completions tools (pure).

A custom tool (`type` absent or "custom", with an `input_schema`) is a chat function whose `parameters`
are that schema. Anthropic's own tools (`web_search_20250305`, `bash_20250124`, `text_editor_*`...) carry a
`type` and no schema: they run on Anthropic's side or are defined by it, so chat has no form for them; they
are dropped and named in the translation's `dropped` as `tools.<name>`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mergebroker.errors import InvalidRequest

_CHOICE_TYPES = ("auto", "any", "tool", "none")
_CHAT_MODES = {"auto": "auto", "any": "required", "none": "none"}


def check_tools(tools: Any) -> None:
    """Raise `InvalidRequest` naming the first malformed tool (None is no tools)."""
    if tools is None:
        return
    if not isinstance(tools, list):
        raise InvalidRequest("tools: must be an array of tools", param="tools", code="invalid_type")
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict):
            raise InvalidRequest(f"{where}: a tool must be an object", param=where, code="invalid_type")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise InvalidRequest(f"{where}.name: a non-empty string is required", param=f"{where}.name",
                                 code="missing_required_parameter")
        if is_custom(tool) and not isinstance(tool.get("input_schema"), dict):
            raise InvalidRequest(f"{where}.input_schema: an object is required", param=f"{where}.input_schema",
                                 code="missing_required_parameter")


def check_tool_choice(choice: Any) -> None:
    """Raise `InvalidRequest` unless `tool_choice` is absent or `{"type": auto|any|tool|none}` (tool: a name)."""
    if choice is None:
        return
    if not isinstance(choice, dict) or choice.get("type") not in _CHOICE_TYPES:
        raise InvalidRequest("tool_choice: an object whose type is auto, any, tool or none is required",
                             param="tool_choice", code="invalid_value")
    if choice["type"] == "tool" and not isinstance(choice.get("name"), str):
        raise InvalidRequest("tool_choice.name: a string is required", param="tool_choice.name",
                             code="missing_required_parameter")


def is_custom(tool: dict[str, Any]) -> bool:
    """A tool the caller defines (and runs): no `type`, type "custom", or any tool with an `input_schema`."""
    return tool.get("type") in (None, "custom") or isinstance(tool.get("input_schema"), dict)


@dataclass(frozen=True)
class ChatTools:
    """The chat side of a request's tools: chat function `tools`, their `names`, and what was `dropped`."""

    tools: tuple[dict[str, Any], ...]
    names: frozenset[str]
    dropped: tuple[str, ...]


def chat_tools(tools: list[dict[str, Any]] | None) -> ChatTools:
    """Chat function tools for checked Messages `tools`; Anthropic's own tools dropped as `tools.<name>`."""
    out: list[dict[str, Any]] = []
    dropped: list[str] = []
    for tool in tools or ():
        if not is_custom(tool):
            dropped.append(f"tools.{tool['name']}")
            continue
        function: dict[str, Any] = {"name": tool["name"]}
        if isinstance(tool.get("description"), str) and tool["description"]:
            function["description"] = tool["description"]
        function["parameters"] = tool["input_schema"]
        if isinstance(tool.get("strict"), bool):
            function["strict"] = tool["strict"]
        out.append({"type": "function", "function": function})
    return ChatTools(tuple(out), frozenset(t["function"]["name"] for t in out), tuple(dropped))


def chat_tool_choice(choice: dict[str, Any] | None, names: frozenset[str]) -> tuple[Any, tuple[str, ...]]:
    """The chat `tool_choice` for a checked Messages one (None: leave it out), and what was dropped.

    A choice that cannot hold once Anthropic's own tools are gone (`any` with no chat tool left, `tool`
    naming one of them) is left out, and named, rather than sent for the upstream to refuse."""
    if choice is None:
        return None, ()
    kind = choice["type"]
    if not names:
        return None, ("tool_choice",) if kind in ("any", "tool") else ()
    if kind == "tool":
        if choice["name"] not in names:
            return None, ("tool_choice",)
        return {"type": "function", "function": {"name": choice["name"]}}, ()
    return _CHAT_MODES[kind], ()
