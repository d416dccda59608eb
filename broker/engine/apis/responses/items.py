"""A Responses request's `input` items: checked at the edge, and listed with ids for the response store (pure).

An item is an object with a `type` (a message may leave it out, as the SDK's `EasyInputMessageParam`
does). Messages are checked for their role and the types of their content parts, function calls and
their outputs for their `call_id`s; every other item type the API defines passes unread (hosted tool
calls, reasoning, compaction...), and a type it does not define is refused, naming the field.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from mergebroker.errors import InvalidRequest

ROLES = ("user", "assistant", "system", "developer")
INPUT_PARTS = ("input_text", "input_image", "input_file")
OUTPUT_PARTS = ("output_text", "refusal")
TEXT_PARTS = ("input_text", "output_text")

# The item types of the SDK's `ResponseInputItemParam` union.
ITEM_TYPES = frozenset((
    "message", "function_call", "function_call_output", "reasoning", "custom_tool_call",
    "custom_tool_call_output", "file_search_call", "computer_call", "computer_call_output", "web_search_call",
    "tool_search_call", "tool_search_output", "additional_tools", "configuration_update", "compaction",
    "compaction_trigger", "image_generation_call", "code_interpreter_call", "local_shell_call",
    "local_shell_call_output", "shell_call", "shell_call_output", "apply_patch_call", "apply_patch_call_output",
    "mcp_list_tools", "mcp_approval_request", "mcp_approval_response", "mcp_call", "item_reference", "program",
    "program_output",
))

_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def check_input(raw: Any, history: Iterable[dict[str, Any]] = (), *, check_calls: bool = True
                ) -> tuple[dict[str, Any], ...]:
    """The request's input as items (a string is one user message), each checked; raise `InvalidRequest`
    naming the first bad field. With `check_calls`, every `function_call_output` must answer a
    `function_call` of the input or of `history` (the earlier items of a `previous_response_id` chain)."""
    if raw is None:
        return ()
    if isinstance(raw, str):
        return ({"type": "message", "role": "user", "content": raw},)
    if not isinstance(raw, list):
        raise InvalidRequest("'input' must be a string or an array of items", param="input")
    for i, item in enumerate(raw):
        _check_item(item, f"input[{i}]")
    if check_calls:
        _check_call_ids(raw, history)
    return tuple(raw)


def item_type(item: dict[str, Any]) -> str:
    """An item's type; a message may leave it out, and an item with only an `id` is a reference."""
    kind = item.get("type")
    if kind is None:
        return "message" if "role" in item else "item_reference"
    return kind


def _check_item(item: Any, where: str) -> None:
    if not isinstance(item, dict):
        raise InvalidRequest(f"'{where}' must be an object", param=where)
    kind = item_type(item)
    if kind not in ITEM_TYPES:
        raise InvalidRequest(f"Invalid value for '{where}.type': {str(kind)[:40]!r}", param=f"{where}.type",
                             code="invalid_value")
    if kind == "message":
        _check_message(item, where)
    elif kind == "function_call":
        for field in ("call_id", "name", "arguments"):
            _require_string(item, field, where, empty_ok=field == "arguments")
    elif kind == "function_call_output":
        _require_string(item, "call_id", where)
        if not isinstance(item.get("output"), (str, list)):
            raise InvalidRequest(f"'{where}.output' must be a string or an array of parts", param=f"{where}.output")


def _check_message(item: dict[str, Any], where: str) -> None:
    role = item.get("role")
    if role not in ROLES:
        raise InvalidRequest(f"Invalid value for '{where}.role': one of {', '.join(ROLES)} is required",
                             param=f"{where}.role", code="invalid_value")
    content = item.get("content")
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise InvalidRequest(f"'{where}.content' must be a string or an array of parts", param=f"{where}.content")
    allowed = OUTPUT_PARTS + ("input_text",) if role == "assistant" else INPUT_PARTS
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict) or part.get("type") not in allowed:
            kind = part.get("type") if isinstance(part, dict) else None
            raise InvalidRequest(f"Invalid value for '{at}.type': {str(kind)[:40]!r}; a {role} message takes "
                                 f"{', '.join(allowed)}", param=f"{at}.type", code="invalid_value")
        if part["type"] in TEXT_PARTS and not isinstance(part.get("text"), str):
            raise InvalidRequest(f"'{at}.text' must be a string", param=f"{at}.text")


def _require_string(item: dict[str, Any], field: str, where: str, *, empty_ok: bool = False) -> None:
    value = item.get(field)
    if not isinstance(value, str) or not (value or empty_ok):
        raise InvalidRequest(f"Missing required parameter: '{where}.{field}'", param=f"{where}.{field}",
                             code="missing_required_parameter")


def _check_call_ids(items: list[dict[str, Any]], history: Iterable[dict[str, Any]]) -> None:
    calls = {item.get("call_id") for source in (history, items) for item in source
             if isinstance(item, dict) and item.get("type") == "function_call"}
    for i, item in enumerate(items):
        if item_type(item) == "function_call_output" and item["call_id"] not in calls:
            raise InvalidRequest(f"No tool call found for function call output with call_id {item['call_id']}.",
                                 param=f"input[{i}].call_id")


def item_id(prefix: str, seed: str, index: int) -> str:
    """A stable id for the `index`th item derived from `seed` (a response id): the same every time."""
    return f"{prefix}_{hashlib.sha256(f'{seed}/{index}'.encode()).hexdigest()[:40]}"


def listed_items(items: Iterable[dict[str, Any]], *, response_id: str) -> list[dict[str, Any]]:
    """The checked input items as `GET /v1/responses/{id}/input_items` lists them: each with an `id`
    (derived from `response_id` where the caller gave none), a `type`, a `status`, and a message's content
    as an array of parts (`input_text` for a string; `output_text` with `annotations` for the assistant)."""
    listed = []
    for index, item in enumerate(items):
        kind = item_type(item)
        full = {**item, "type": kind}
        if not full.get("id"):
            full["id"] = item_id(_ID_PREFIXES.get(kind, "item"), f"{response_id}/input", index)
        if kind == "message":
            full["content"] = _listed_content(item["role"], item["content"])
        if kind in ("message", "function_call", "function_call_output"):
            full.setdefault("status", "completed")
        listed.append(full)
    return listed


def _listed_content(role: str, content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    if role != "assistant":
        return [{"type": "input_text", "text": content}] if isinstance(content, str) else list(content)
    parts = [{"type": "output_text", "text": content}] if isinstance(content, str) else content
    return [{**part, "type": "output_text", "annotations": part.get("annotations") or []}
            if part["type"] in TEXT_PARTS else part for part in parts]
