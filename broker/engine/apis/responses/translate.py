"""A Responses request as the Chat Completions body the engine runs (pure).

`instructions` become the first system message, then the earlier responses' items (`history`, for a
`previous_response_id` chain), then the input. Parameters chat shares keep their names; those with
another name there move (`max_output_tokens` -> `max_completion_tokens`, `reasoning.effort` ->
`reasoning_effort`, `text.format` -> `response_format`). What chat cannot carry is left out, and named
in `dropped` when leaving it out changes what the caller gets (a hosted tool, `text.verbosity`, an
`include` of `reasoning.encrypted_content`); what the broker itself handles (`store`, `background`,
`previous_response_id`) or what changes nothing (`client_metadata`, `stream_options`) goes unnamed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from mergebroker.broker.engine.apis.responses.messages import chat_messages
from mergebroker.broker.engine.apis.responses.request import ResponsesRequest
from mergebroker.broker.engine.apis.responses.tools import ToolNames, chat_tool_choice, chat_tools

# Same name, same meaning in both APIs.
_SHARED = ("temperature", "top_p", "user", "service_tier", "prompt_cache_key", "prompt_cache_retention",
           "safety_identifier", "broker")
# Without a chat form; named in `dropped` when present, since leaving them out changes the answer.
_NAMED_WHEN_SET = ("prompt", "conversation", "max_tool_calls", "context_management", "top_logprobs",
                   "moderation")


@dataclass(frozen=True)
class ChatTranslation:
    """The chat body for a Responses request, what could not cross (`dropped`: `tools.web_search`,
    `input.reasoning`, `text.verbosity`...), and each chat tool name's `(namespace, name)`."""

    body: dict[str, Any]
    dropped: tuple[str, ...]
    tool_names: ToolNames


def to_chat(request: ResponsesRequest, *, history: Iterable[dict[str, Any]] = ()) -> ChatTranslation:
    """The Chat Completions body for `request`, with `history` (the input and output items of the earlier
    responses of its `previous_response_id` chain) before its input. A streamed request asks for usage
    in the stream's last chunk (`stream_options.include_usage`), which the Responses stream reports."""
    raw = request.body
    dropped: list[str] = []
    messages = [{"role": "system", "content": request.instructions}] if request.instructions else []
    messages += chat_messages([*history, *request.input], dropped)
    body: dict[str, Any] = {"model": request.model, "messages": messages}
    tools = chat_tools(list(request.tools))
    dropped += tools.dropped
    if tools.tools:
        body["tools"] = list(tools.tools)
        if raw.get("parallel_tool_calls") is not None:
            body["parallel_tool_calls"] = raw["parallel_tool_calls"]
    choice, choice_dropped = chat_tool_choice(raw.get("tool_choice"), tools.names)
    dropped += choice_dropped
    if choice is not None:
        body["tool_choice"] = choice
    body.update({name: raw[name] for name in _SHARED if raw.get(name) is not None})
    if request.max_output_tokens is not None:
        body["max_completion_tokens"] = request.max_output_tokens
    _text(raw.get("text") or {}, body, dropped)
    _reasoning(raw.get("reasoning") or {}, body, dropped)
    dropped += _unsupported(raw)
    if request.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return ChatTranslation(body, tuple(dict.fromkeys(dropped)), tools.names)


def _text(text: dict[str, Any], body: dict[str, Any], dropped: list[str]) -> None:
    fmt = text.get("format") or {}
    if fmt.get("type") == "json_schema":
        schema = {"name": fmt["name"], "schema": fmt["schema"]}
        schema.update({key: fmt[key] for key in ("description", "strict") if fmt.get(key) is not None})
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif fmt.get("type") == "json_object":
        body["response_format"] = {"type": "json_object"}
    if text.get("verbosity") is not None:
        dropped.append("text.verbosity")


def _reasoning(reasoning: dict[str, Any], body: dict[str, Any], dropped: list[str]) -> None:
    if reasoning.get("effort") is not None:
        body["reasoning_effort"] = reasoning["effort"]
    dropped += [f"reasoning.{key}" for key in ("summary", "generate_summary") if reasoning.get(key) is not None]


def _unsupported(raw: dict[str, Any]) -> list[str]:
    named = [name for name in _NAMED_WHEN_SET if raw.get(name) is not None]
    # Chat takes `metadata` only with `store`, which the broker never asks of an upstream; it is echoed.
    if raw.get("metadata"):
        named.append("metadata")
    if raw.get("truncation") == "auto":
        named.append("truncation")
    named += [f"include.{entry}" for entry in raw.get("include") or () if isinstance(entry, str)]
    return named
