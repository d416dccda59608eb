"""A Responses create body, checked at the edge, and what the broker needs to read from it (pure).

A malformed body gets its 400 before it waits anywhere, naming the field as OpenAI does
(`input[2].call_id`, `max_output_tokens`). Only what the broker routes on is lifted out; everything else
stays in `body`, which the native path forwards as it came.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from mergebroker.broker.engine.apis.responses.items import TEXT_PARTS, check_input, item_type
from mergebroker.broker.engine.apis.responses.tools import NAME, check_tool_choice, check_tools
from mergebroker.errors import InvalidRequest

MIN_OUTPUT_TOKENS = 16
"""OpenAI refuses a smaller `max_output_tokens` (`integer_below_min_value`)."""

_FORMATS = ("text", "json_schema", "json_object")


@dataclass(frozen=True)
class ResponsesRequest:
    """A checked `POST /v1/responses` body.

    `input` is the input as items (a string input is one user message); `text_only` is true when the
    request is plain text in, plain text out: messages of text parts only, no tools, no earlier response,
    no structured output, not in the background (the only kind the broker may merge with chat requests;
    the sampling rule is the caller's)."""

    body: dict[str, Any]
    model: str
    input: tuple[dict[str, Any], ...]
    stream: bool
    store: bool
    background: bool
    previous_response_id: str | None
    instructions: str | None
    tools: tuple[dict[str, Any], ...]
    max_output_tokens: int | None
    text_only: bool


def parse_request(raw: Any, *, history: Iterable[dict[str, Any]] = ()) -> ResponsesRequest:
    """Check a Responses create body; raise `InvalidRequest` naming the first bad field.

    `history` is the items of the earlier responses of a `previous_response_id` chain, where the caller
    holds them: a `function_call_output` must answer a `function_call` there or in the input. When the
    request continues a response the caller does not hold (`previous_response_id` with no history: the
    upstream keeps that state), the outputs are not checked."""
    if not isinstance(raw, dict):
        raise InvalidRequest("The request body must be a JSON object")
    model = raw.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("Missing required parameter: 'model'", param="model", code="missing_required_parameter")
    flags = {name: _flag(raw, name, default) for name, default in
             (("stream", False), ("store", True), ("background", False), ("parallel_tool_calls", True))}
    previous = _optional_string(raw, "previous_response_id")
    instructions = _optional_string(raw, "instructions")
    history = tuple(history)
    items = check_input(raw.get("input"), history, check_calls=previous is None or bool(history))
    if not items and not history and previous is None:  # nothing for the model to answer
        raise InvalidRequest("Missing required parameter: 'input'", param="input", code="missing_required_parameter")
    check_tools(raw.get("tools"))
    check_tool_choice(raw.get("tool_choice"))
    _check_sampling(raw)
    _check_objects(raw)
    return ResponsesRequest(
        body=raw, model=model, input=items, stream=flags["stream"], store=flags["store"],
        background=flags["background"], previous_response_id=previous, instructions=instructions,
        tools=tuple(raw.get("tools") or ()), max_output_tokens=raw.get("max_output_tokens"),
        text_only=_text_only(raw, items, previous, flags["background"]))


def _flag(raw: dict[str, Any], name: str, default: bool) -> bool:
    value = raw.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"Invalid type for '{name}': expected a boolean", param=name, code="invalid_type")
    return value


def _optional_string(raw: dict[str, Any], name: str) -> str | None:
    value = raw.get(name)
    if value is not None and not isinstance(value, str):
        raise InvalidRequest(f"Invalid type for '{name}': expected a string", param=name, code="invalid_type")
    return value or None


def _check_sampling(raw: dict[str, Any]) -> None:
    limit = raw.get("max_output_tokens")
    if limit is not None:
        if not isinstance(limit, int) or isinstance(limit, bool):
            raise InvalidRequest("Invalid type for 'max_output_tokens': expected an integer",
                                 param="max_output_tokens", code="invalid_type")
        if limit < MIN_OUTPUT_TOKENS:
            raise InvalidRequest(f"Invalid 'max_output_tokens': integer below minimum value. Expected a value >= "
                                 f"{MIN_OUTPUT_TOKENS}, but got {limit} instead.", param="max_output_tokens",
                                 code="integer_below_min_value")
    for name, high in (("temperature", 2), ("top_p", 1)):
        value = raw.get(name)
        if value is None:
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= high:
            raise InvalidRequest(f"Invalid '{name}': a number from 0 to {high} is required", param=name,
                                 code="invalid_value")


def _check_objects(raw: dict[str, Any]) -> None:
    for name in ("text", "reasoning", "metadata", "broker"):
        if raw.get(name) is not None and not isinstance(raw[name], dict):
            raise InvalidRequest(f"Invalid type for '{name}': expected an object", param=name, code="invalid_type")
    fmt = (raw.get("text") or {}).get("format")
    if fmt is None:
        return
    if not isinstance(fmt, dict) or fmt.get("type") not in _FORMATS:
        raise InvalidRequest("Invalid 'text.format': its type must be text, json_schema or json_object",
                             param="text.format.type", code="invalid_value")
    if fmt["type"] == "json_schema":
        if not isinstance(fmt.get("name"), str) or NAME.fullmatch(fmt["name"]) is None:
            raise InvalidRequest("Invalid 'text.format.name': 1 to 64 letters, digits, '_' or '-' are required",
                                 param="text.format.name", code="invalid_value")
        if not isinstance(fmt.get("schema"), dict):
            raise InvalidRequest("Missing required parameter: 'text.format.schema'", param="text.format.schema",
                                 code="missing_required_parameter")


def _text_only(raw: dict[str, Any], items: tuple[dict[str, Any], ...], previous: str | None,
               background: bool) -> bool:
    if raw.get("tools") or previous or background or raw.get("prompt") or raw.get("conversation"):
        return False
    if ((raw.get("text") or {}).get("format") or {"type": "text"}).get("type") != "text":
        return False
    return all(item_type(item) == "message" and _text_content(item["content"]) for item in items)


def _text_content(content: str | list[dict[str, Any]]) -> bool:
    return isinstance(content, str) or all(part["type"] in TEXT_PARTS for part in content)
