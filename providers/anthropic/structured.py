"""Structured output (`response_format`) over the Messages API, and what it means for reading the reply (pure).

`json_schema` goes to Anthropic's native structured output (`output_config.format`) for the models that
have it (`NATIVE_STRUCTURED_OUTPUT`, matched on the Anthropic model name), else to the forced-single-tool
technique: one tool whose input schema is the requested schema, and a `tool_choice` naming it, so the
tool's input is the answer. `json_object` always takes the tool: native structured output wants closed
schemas, and `json_object` asks for any object. A request with its own tools cannot have its tool choice
forced, so it needs native structured output. `ReplyShape` tells the reply's reader what was asked:
the forced tool's input becomes `message.content`, and a refusal becomes `message.refusal`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mergebroker.providers.anthropic.refuse import refuse

NATIVE_STRUCTURED_OUTPUT: tuple[str, ...] = (
    "claude-opus-4-1*", "claude-opus-4-5*", "claude-opus-4-6*", "claude-opus-4-7*", "claude-opus-4-8*",
    "claude-sonnet-4-5*", "claude-sonnet-4-6*", "claude-haiku-4-5*", "claude-opus-5*", "claude-sonnet-5*",
    "claude-haiku-5*", "claude-fable-5*", "claude-mythos-*",
)
"""Anthropic models with native structured output (glob patterns); others get the forced tool."""

JSON_TOOL = "json_response"
"""The forced tool's name when the schema has none (`json_object`)."""
_JSON_TOOL_DESCRIPTION = "Give your answer by calling this tool: its input is the answer, as JSON."
_OPEN_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ReplyShape:
    """How to read a reply: `json_tool` is the forced tool whose input is the answer's content (None without
    one); `structured` says the caller asked for JSON, so a refusal goes to `message.refusal`."""

    json_tool: str | None = None
    structured: bool = False


def to_output(response_format: Any, *, model: str, has_tools: bool,
              native: Sequence[str] = NATIVE_STRUCTURED_OUTPUT) -> tuple[dict[str, Any], ReplyShape]:
    """The Messages body fields for OpenAI's `response_format` on `model`, and how to read the reply."""
    if response_format is None:
        return {}, ReplyShape()
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return {}, ReplyShape()
    if kind == "json_object":
        return _forced_tool(JSON_TOOL, _OPEN_OBJECT, None, strict=False, has_tools=has_tools)
    if kind != "json_schema":
        raise refuse("response_format.type", "only text, json_object and json_schema are translated")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise refuse("response_format.json_schema", "a json_schema response format needs its json_schema object")
    schema = spec.get("schema") if spec.get("schema") is not None else _OPEN_OBJECT
    if not isinstance(schema, dict):
        raise refuse("response_format.json_schema.schema", "the schema must be a JSON object")
    if any(fnmatch.fnmatchcase(model, pattern) for pattern in native):
        return {"output_config": {"format": {"type": "json_schema", "schema": schema}}}, ReplyShape(structured=True)
    given = spec.get("name")
    name = given if isinstance(given, str) and given else JSON_TOOL
    return _forced_tool(name, schema, spec.get("description"), strict=spec.get("strict") is True, has_tools=has_tools)


def _forced_tool(name: str, schema: dict[str, Any], description: Any, *, strict: bool,
                 has_tools: bool) -> tuple[dict[str, Any], ReplyShape]:
    if has_tools:
        raise refuse("response_format", "with tools of its own, a request can get structured output only from a "
                                        "model with native structured output (the forced tool would block them)")
    if schema.get("type", "object") != "object":
        raise refuse("response_format.json_schema.schema", "without native structured output the answer travels "
                                                           "as a tool's input, which must be an object")
    tool: dict[str, Any] = {"name": name, "description": description if isinstance(description, str) and description
                            else _JSON_TOOL_DESCRIPTION, "input_schema": {"type": "object", **schema}}
    if strict:
        tool["strict"] = True
    fields = {"tools": [tool], "tool_choice": {"type": "tool", "name": name}}
    return fields, ReplyShape(json_tool=name, structured=True)
