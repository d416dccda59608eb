"""What the simulator's Responses mode reads from a request (pure): input items, the conversation they make, tools.

A Responses body's `input` is a string (one user message) or a list of items: messages (roles user, assistant,
system, developer; content a string or parts `input_text`, `input_image`, `output_text`, ...), `function_call`,
`function_call_output`, `reasoning` and any other item the API defines (kept, not read). `conversation` turns
the items into the chat-shaped messages the simulator's content rules and prompt cache read (`instructions`
first, as a system message), so a Responses call gets the very answer and token counts a chat call with the
same conversation gets. Function tools come flat (`{"type": "function", "name", "parameters"}`) or grouped
under a `namespace` tool; hosted tools (`web_search`, `file_search`, ...) and custom tools are accepted and
never called. Unknown top-level fields are accepted rather than refused: agents (Codex CLI) send fields newer
than any list here, and a refusal would break them for no test's benefit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mergebroker.errors import InvalidRequest
from mergebroker.providers.simulator.content import message_text
from mergebroker.providers.simulator.faults import is_int

ROLES = ("user", "assistant", "system", "developer")
OUTPUT_TYPES = ("function_call_output", "custom_tool_call_output")
_FORMATS = ("text", "json_schema", "json_object")


def _invalid(message: str, param: str) -> InvalidRequest:
    return InvalidRequest(message, param=param, code="invalid_value")


def input_items(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The request's input as a list of typed items (a string input is one user message); raises `InvalidRequest`."""
    raw = body.get("input")
    if raw is None:
        return []
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": raw}]}]
    if not isinstance(raw, list):
        raise _invalid("Invalid type for 'input': expected a string or an array of input items.", "input")
    return [_item(item, f"input[{i}]") for i, item in enumerate(raw)]


def _item(item: Any, where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise _invalid(f"Invalid type for '{where}': expected an object.", where)
    kind = item.get("type") or ("message" if "role" in item else None)
    if not isinstance(kind, str):
        raise _invalid(f"Missing required parameter: '{where}.type'.", f"{where}.type")
    if kind == "message":
        if item.get("role") not in ROLES:
            raise _invalid(f"Invalid value for '{where}.role': expected one of {', '.join(ROLES)}.", f"{where}.role")
        content = item.get("content")
        if not isinstance(content, str) and not (isinstance(content, list)
                                                 and all(isinstance(p, dict) and "type" in p for p in content)):
            raise _invalid(f"Invalid type for '{where}.content': expected a string or an array of content parts.",
                           f"{where}.content")
    elif kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise _invalid(f"Missing required parameter: '{where}.{key}'.", f"{where}.{key}")
    elif kind in OUTPUT_TYPES:
        if not isinstance(item.get("call_id"), str) or "output" not in item:
            raise _invalid(f"Missing required parameter: '{where}.call_id' and '{where}.output'.", where)
    return {**item, "type": kind}


def output_text(item: Mapping[str, Any]) -> str:
    """The text of a tool output item: its string output, or its text parts joined."""
    output = item.get("output")
    return output if isinstance(output, str) else message_text(output)


def conversation(instructions: Any, items: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The items as chat-shaped messages (`instructions` first as the system message); tool calls and their
    outputs become assistant and tool turns, reasoning and other items are not part of the prompt's text."""
    messages: list[dict[str, Any]] = []
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    for item in items:
        kind = item.get("type")
        if kind == "message":
            messages.append({"role": item["role"], "content": item["content"]})
        elif kind == "function_call":
            messages.append({"role": "assistant", "content": f"{item['name']}({item['arguments']})"})
        elif kind in OUTPUT_TYPES:
            messages.append({"role": "tool", "content": output_text(item)})
    return messages


def trailing_outputs(items: Sequence[Mapping[str, Any]]) -> list[str]:
    """The texts of the tool outputs that end the input (empty when the input ends otherwise)."""
    outputs: list[str] = []
    for item in reversed(items):
        if item.get("type") not in OUTPUT_TYPES:
            break
        outputs.append(output_text(item))
    return outputs[::-1]


def ends_with_user(items: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the last input item is a user message (the turn a model answers with tool calls)."""
    return bool(items) and items[-1].get("type") == "message" and items[-1].get("role") == "user"


@dataclass(frozen=True)
class ToolSet:
    """The function tools the model may call: (name, schema) mappings for `agent.tool_calls`, each with the
    namespace it came from (None for a flat tool); the choice (`none`, `auto`, `any`, `tool`) and its tool."""

    tools: tuple[dict[str, Any], ...]
    choice: str = "auto"
    named: str | None = None

    def namespace_of(self, name: str) -> str | None:
        """The namespace the tool called `name` belongs to, if any."""
        return next((t["namespace"] for t in self.tools if t["name"] == name), None)


def tool_set(body: Mapping[str, Any]) -> ToolSet:
    """The request's function tools (namespaces flattened) and its `tool_choice`; raises `InvalidRequest`."""
    raw = body.get("tools") or []
    if not isinstance(raw, list) or not all(isinstance(t, dict) and isinstance(t.get("type"), str) for t in raw):
        raise _invalid("Invalid type for 'tools': expected an array of tool objects with a 'type'.", "tools")
    tools = [*_functions(raw, None, "tools")]
    for i, tool in enumerate(raw):
        if tool["type"] == "namespace":
            if not isinstance(tool.get("name"), str) or not isinstance(tool.get("tools"), list):
                raise _invalid(f"Missing required parameter: 'tools[{i}].name' or 'tools[{i}].tools'.", f"tools[{i}]")
            tools += _functions(tool["tools"], tool["name"], f"tools[{i}].tools")
    return _with_choice(tuple(tools), body.get("tool_choice"))


def _functions(tools: list[Any], namespace: str | None, where: str) -> list[dict[str, Any]]:
    found = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            continue
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise _invalid(f"Missing required parameter: '{where}[{i}].name'.", f"{where}[{i}].name")
        found.append({"name": tool["name"], "schema": tool.get("parameters") or {}, "namespace": namespace})
    return found


def _with_choice(tools: tuple[dict[str, Any], ...], choice: Any) -> ToolSet:
    if choice is None or choice == "auto":
        return ToolSet(tools)
    if choice in ("none", "required"):
        return ToolSet(tools, "none" if choice == "none" else "any")
    if not isinstance(choice, dict):
        raise _invalid("Invalid value for 'tool_choice'.", "tool_choice")
    if choice.get("type") == "function":
        if choice.get("name") not in {t["name"] for t in tools}:
            raise _invalid(f"Tool choice '{choice.get('name')}' not found in 'tools' parameter.", "tool_choice")
        return ToolSet(tools, "tool", choice["name"])
    if choice.get("type") == "allowed_tools":
        allowed = {t.get("name") for t in choice.get("tools") or [] if isinstance(t, dict)}
        kept = tuple(t for t in tools if t["name"] in allowed)
        return ToolSet(kept, "any" if choice.get("mode") == "required" else "auto")
    return ToolSet(tools, "none")  # a hosted tool is chosen: the simulated model calls no function


def text_format(body: Mapping[str, Any]) -> dict[str, Any]:
    """`text.format` (default `{"type": "text"}`); raises `InvalidRequest` for a format the API refuses."""
    text = body.get("text") or {}
    fmt = text.get("format") if isinstance(text, dict) else None
    fmt = fmt or {"type": "text"}
    if not isinstance(fmt, dict) or fmt.get("type") not in _FORMATS:
        raise _invalid(f"Invalid value for 'text.format.type': expected one of {', '.join(_FORMATS)}.",
                       "text.format.type")
    if fmt["type"] == "json_schema" and not (isinstance(fmt.get("name"), str) and isinstance(fmt.get("schema"), dict)):
        raise _invalid("Missing required parameter: 'text.format.name' and 'text.format.schema'.", "text.format")
    return fmt


def check_body(body: Mapping[str, Any]) -> None:
    """The scalar fields' checks (`InvalidRequest` naming the field). The minimum of 16 `max_output_tokens` that
    OpenAI enforces is not: tests cut the simulator's short answers with smaller budgets."""
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise InvalidRequest("Missing required parameter: 'model'.", param="model", code="missing_required_parameter")
    limit = body.get("max_output_tokens")
    if limit is not None and not (is_int(limit) and limit >= 1):
        raise _invalid("Invalid 'max_output_tokens': expected an integer >= 1.", "max_output_tokens")
    for name, high in (("temperature", 2), ("top_p", 1)):
        value = body.get(name)
        if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                      and 0 <= value <= high):
            raise _invalid(f"Invalid '{name}': expected a number between 0 and {high}.", name)
    for name in ("store", "stream", "parallel_tool_calls", "background"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise _invalid(f"Invalid type for '{name}': expected a boolean.", name)
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise _invalid("Invalid type for 'metadata': expected an object.", "metadata")
    if body.get("include") is not None and not isinstance(body["include"], list):
        raise _invalid("Invalid type for 'include': expected an array.", "include")
