"""A Responses request's `tools` and `tool_choice`: checked, and turned into Chat Completions tools (pure).

Responses function tools are flat (`{"type": "function", "name", "parameters", ...}`); chat nests them
(`{"type": "function", "function": {...}}`). A `namespace` tool (the SDK's `NamespaceTool`: `name`,
`description`, `tools` of functions) has no chat form, so its functions are flattened to `NS__name`, a
valid chat name of at most 64 characters (a longer one keeps its head and takes a hash of the pair as its
tail), and `ToolNames` maps each chat name back to `(namespace, name)` so a reply's calls carry the
namespace again (`function_call.namespace`). Hosted tools (web search, file search, code interpreter...)
run on OpenAI's side only: they are dropped, and named in the translation's `dropped`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from mergebroker.errors import InvalidRequest

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_MAX_NAME = 64
_SEPARATOR = "__"
_CHOICE_MODES = ("none", "auto", "required")

ToolNames = Mapping[str, "tuple[str | None, str]"]
"""A chat tool name -> (namespace or None, the caller's function name)."""


def check_tools(tools: Any) -> None:
    """Raise `InvalidRequest` naming the first malformed tool of a Responses `tools` array (None is none).

    Tool types this module does not know pass: they are hosted tools, dropped in translation."""
    if tools is None:
        return
    if not isinstance(tools, list):
        raise InvalidRequest("'tools' must be an array of tools", param="tools")
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise InvalidRequest(f"'{where}' must be an object", param=where)
        kind = tool.get("type")
        if not isinstance(kind, str):
            raise InvalidRequest(f"'{where}.type' must be a string", param=f"{where}.type")
        if kind in ("function", "custom"):
            check_name(tool.get("name"), f"{where}.name")
        elif kind == "namespace":
            _check_namespace(tool, where)


def check_tool_choice(choice: Any) -> None:
    """Raise `InvalidRequest` when `tool_choice` is neither a mode string nor an object with a `type`."""
    if choice is None:
        return
    if isinstance(choice, str):
        if choice not in _CHOICE_MODES:
            raise InvalidRequest("'tool_choice' must be 'none', 'auto', 'required' or an object",
                                 param="tool_choice")
        return
    if not isinstance(choice, dict) or not isinstance(choice.get("type"), str):
        raise InvalidRequest("'tool_choice' must be a string or an object with a 'type'", param="tool_choice")
    if choice["type"] == "function":
        check_name(choice.get("name"), "tool_choice.name")


def check_name(name: Any, where: str) -> None:
    """A function (or namespace) name as OpenAI takes it: 1 to 64 of `[a-zA-Z0-9_-]`."""
    if name is None:
        raise InvalidRequest(f"Missing required parameter: '{where}'", param=where, code="missing_required_parameter")
    if not isinstance(name, str) or NAME.fullmatch(name) is None:
        raise InvalidRequest(f"Invalid '{where}': a name of 1 to 64 letters, digits, '_' or '-' is required",
                             param=where, code="invalid_value")


def _check_namespace(tool: dict[str, Any], where: str) -> None:
    check_name(tool.get("name"), f"{where}.name")
    inner = tool.get("tools")
    if not isinstance(inner, list):
        raise InvalidRequest(f"'{where}.tools' must be an array of tools", param=f"{where}.tools")
    for j, member in enumerate(inner):
        at = f"{where}.tools[{j}]"
        if not isinstance(member, dict):
            raise InvalidRequest(f"'{at}' must be an object", param=at)
        check_name(member.get("name"), f"{at}.name")


def flat_name(namespace: str | None, name: str) -> str:
    """The chat name of `name` inside `namespace`: `NS__name`, or its first characters and a hash of the
    pair when that passes 64 characters. Deterministic, so earlier turns' calls map to the same name."""
    if namespace is None:
        return name
    joined = f"{namespace}{_SEPARATOR}{name}"
    if len(joined) <= _MAX_NAME:
        return joined
    digest = hashlib.sha256(f"{namespace}\0{name}".encode()).hexdigest()[:10]
    return f"{joined[:_MAX_NAME - len(digest) - 1]}_{digest}"


@dataclass(frozen=True)
class ChatTools:
    """The chat side of a request's tools: `tools` (chat tool objects), `names`, and what was dropped."""

    tools: tuple[dict[str, Any], ...]
    names: ToolNames
    dropped: tuple[str, ...]


def chat_tools(tools: list[dict[str, Any]] | None) -> ChatTools:
    """Chat function tools for checked Responses `tools`: functions kept, namespaces flattened, the rest
    (hosted tools, custom tools) dropped and named as `tools.<type>`."""
    out: list[dict[str, Any]] = []
    names: dict[str, tuple[str | None, str]] = {}
    dropped: list[str] = []
    for tool in tools or ():
        kind = tool["type"]
        if kind == "function":
            out.append(_chat_function(tool, None, None))
            names[tool["name"]] = (None, tool["name"])
        elif kind == "namespace":
            for member in tool["tools"]:
                if member.get("type", "function") != "function":
                    dropped.append(f"tools.{member.get('type')}")
                    continue
                chat = _chat_function(member, tool["name"], tool.get("description"))
                out.append(chat)
                names[chat["function"]["name"]] = (tool["name"], member["name"])
        else:
            dropped.append(f"tools.{kind}")
    return ChatTools(tuple(out), MappingProxyType(names), tuple(dropped))


def _chat_function(tool: dict[str, Any], namespace: str | None, context: str | None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": flat_name(namespace, tool["name"])}
    # The namespace's own description would otherwise be lost: the model reads it before the function's.
    description = "\n\n".join(d for d in (context, tool.get("description")) if isinstance(d, str) and d)
    if description:
        function["description"] = description
    if tool.get("parameters") is not None:
        function["parameters"] = tool["parameters"]
    if tool.get("strict") is not None:
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def chat_tool_choice(choice: Any, names: ToolNames) -> tuple[Any, tuple[str, ...]]:
    """The chat `tool_choice` for a checked Responses one (None: leave it out), and what was dropped.

    A choice of a hosted tool, or of tools none of which survived translation, becomes the default."""
    if choice is None:
        return None, ()
    if not names:
        return None, ("tool_choice",) if choice not in ("auto", "none") else ()
    if isinstance(choice, str):
        return choice, ()
    kind = choice["type"]
    if kind == "function" and (chat := _chat_name(choice, names)) is not None:
        return {"type": "function", "function": {"name": chat}}, ()
    if kind == "allowed_tools":
        allowed = [{"type": "function", "function": {"name": chat}} for t in choice.get("tools") or ()
                   if isinstance(t, dict) and t.get("type") == "function" and (chat := _chat_name(t, names))]
        if allowed:
            return {"type": "allowed_tools",
                    "allowed_tools": {"mode": choice.get("mode", "auto"), "tools": allowed}}, ()
    return None, ("tool_choice",)


def _chat_name(choice: dict[str, Any], names: ToolNames) -> str | None:
    """The chat name of the function a choice names: its own, its `namespace`'s flat one, or the one
    namespaced function of that name; None when no chat tool has it."""
    name, namespace = choice.get("name"), choice.get("namespace")
    if not isinstance(name, str):
        return None
    if namespace is None and name in names:
        return name
    matches = [chat for chat, (ns, plain) in names.items()
               if plain == name and (ns == namespace or namespace is None and ns is not None)]
    return matches[0] if len(matches) == 1 else None
