"""The shapes of a chat request's `tools` and `tool_choice`, checked at the edge (pure).

A malformed tool would only be refused by the upstream, after the request waited in a queue and perhaps
cost a merged call its partner; here it gets the 400 at once, naming the field as OpenAI does
(`tools[0].function.name`). The shapes are the official spec's: function tools (`{"type": "function",
"function": {"name", "description"?, "parameters"?, "strict"?}}`) and custom tools (`{"type": "custom",
"custom": {"name", "description"?, "format"?}}`); `tool_choice` is "none", "auto", "required", a named
function or custom tool, or `allowed_tools`. Fields the spec does not name inside them pass untouched.
"""

from __future__ import annotations

import re
from typing import Any

from mergebroker.errors import InvalidRequest

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CHOICE_MODES = ("none", "auto", "required")


def check_tools(tools: Any) -> None:
    """Raise `InvalidRequest` naming the first malformed part of `tools` (None is no tools)."""
    if tools is None:
        return
    if not isinstance(tools, list):
        raise _invalid("tools", "must be an array of tools")
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _invalid(where, "must be an object")
        kind = tool.get("type")
        if kind == "function":
            _check_function(tool.get("function"), where + ".function")
        elif kind == "custom":
            _check_custom(tool.get("custom"), where + ".custom")
        else:
            raise _invalid(where + ".type", "must be 'function' or 'custom'")


def check_tool_choice(choice: Any) -> None:
    """Raise `InvalidRequest` naming the malformed part of `tool_choice` (None is the default)."""
    if choice is None:
        return
    if isinstance(choice, str):
        if choice not in _CHOICE_MODES:
            raise _invalid("tool_choice", "must be 'none', 'auto', 'required' or an object naming a tool")
        return
    if not isinstance(choice, dict):
        raise _invalid("tool_choice", "must be a string or an object")
    kind = choice.get("type")
    if kind in ("function", "custom"):
        named = choice.get(kind)
        if not isinstance(named, dict):
            raise _invalid(f"tool_choice.{kind}", "must be an object")
        _check_name(named.get("name"), f"tool_choice.{kind}.name")
    elif kind == "allowed_tools":
        allowed = choice.get("allowed_tools")
        if not isinstance(allowed, dict):
            raise _invalid("tool_choice.allowed_tools", "must be an object")
        if allowed.get("mode") not in ("auto", "required"):
            raise _invalid("tool_choice.allowed_tools.mode", "must be 'auto' or 'required'")
        listed = allowed.get("tools")
        if not isinstance(listed, list) or not all(isinstance(t, dict) for t in listed):
            raise _invalid("tool_choice.allowed_tools.tools", "must be an array of objects")
    else:
        raise _invalid("tool_choice.type", "must be 'function', 'custom' or 'allowed_tools'")


def _check_function(function: Any, where: str) -> None:
    if not isinstance(function, dict):
        raise _invalid(where, "must be an object")
    _check_name(function.get("name"), where + ".name")
    _optional(function, "description", str, "a string", where)
    _optional(function, "parameters", dict, "an object (a JSON Schema)", where)
    _optional(function, "strict", bool, "a boolean", where)


def _check_custom(custom: Any, where: str) -> None:
    if not isinstance(custom, dict):
        raise _invalid(where, "must be an object")
    _check_name(custom.get("name"), where + ".name")
    _optional(custom, "description", str, "a string", where)
    _optional(custom, "format", dict, "an object", where)


def _check_name(name: Any, where: str) -> None:
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise _invalid(where, "must be a string of 1 to 64 letters, digits, underscores or dashes")


def _optional(node: dict[str, Any], key: str, kind: type, described: str, where: str) -> None:
    value = node.get(key)
    if value is not None and not isinstance(value, kind):
        raise _invalid(f"{where}.{key}", f"must be {described}")


def _invalid(param: str, problem: str) -> InvalidRequest:
    return InvalidRequest(f"Invalid value for '{param}': {problem}.", param=param, code="invalid_value")
