"""A Chat Completions reply as an Anthropic Message (pure).

The content is a `thinking` block when the reply shows its reasoning (`reasoning_content` or `reasoning`)
and the caller asked for thinking, a `text` block when there is text, then one `tool_use` block per tool
call. A reply with neither text nor calls still gets one empty text block: a Message always has content.
Its thinking has no signature (`""`): only Anthropic signs thinking, and the chat path drops it from later
turns anyway.
"""

from __future__ import annotations

import json
from typing import Any

from mergebroker.broker.engine.apis.messages.request import MessagesRequest
from mergebroker.token_usage import NO_USAGE, TokenUsage

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use",
                 "content_filter": "refusal"}


def from_chat(reply: dict[str, Any], request: MessagesRequest, *, message_id: str) -> dict[str, Any]:
    """The Message for a chat completion `reply` to `request`."""
    choices = reply.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    found = choice.get("message")
    message: dict[str, Any] = found if isinstance(found, dict) else {}
    content: list[dict[str, Any]] = []
    reasoning = reasoning_text(message)
    if request.thinking and reasoning:
        content.append(thinking_block(reasoning))
    calls = [call for call in message.get("tool_calls") or () if isinstance(call, dict)]
    text = message.get("content") if isinstance(message.get("content"), str) else ""
    if text or not calls:
        content.append({"type": "text", "text": text})
    for position, call in enumerate(calls):
        given = call.get("function")
        function: dict[str, Any] = given if isinstance(given, dict) else {}
        content.append(tool_use_block(call.get("id") or tool_use_id(message_id, position),
                                      function.get("name") or "", tool_input(function.get("arguments"))))
    return message_object(message_id, reply.get("model") or request.model, content,
                          stop_reason(choice.get("finish_reason"), has_calls=bool(calls)),
                          TokenUsage.from_body(reply) or NO_USAGE)


def message_object(message_id: str, model: str, content: list[dict[str, Any]], stop: str | None,
                   usage: TokenUsage) -> dict[str, Any]:
    """The Message object (also the one a stream's `message_start` carries, with empty content)."""
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop, "stop_sequence": None, "usage": usage.as_anthropic()}


def stop_reason(finish_reason: str | None, *, has_calls: bool) -> str:
    """The Messages `stop_reason` for a chat `finish_reason`. Some providers end a turn of tool calls with
    "stop"; the caller runs the tools only when told `tool_use`, so calls win over a plain stop."""
    if has_calls and finish_reason in (None, "stop"):
        return "tool_use"
    return _STOP_REASONS.get(finish_reason or "stop", "end_turn")


def reasoning_text(message: dict[str, Any]) -> str | None:
    """The reasoning a chat message (or a stream's delta) shows, under either name providers give it."""
    text = message.get("reasoning_content") or message.get("reasoning")
    return text if isinstance(text, str) else None


def thinking_block(text: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": text, "signature": ""}


def tool_use_block(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """A `tool_use` block. The call id is kept as the upstream gave it (even without `toolu_`): the caller
    sends it back in its `tool_result`, and the chat upstream then finds its own id again."""
    return {"type": "tool_use", "id": call_id, "name": name, "input": arguments}


def tool_use_id(message_id: str, position: int) -> str:
    """An id for a call the upstream gave none, stable for one message and place."""
    return f"toolu_{message_id.removeprefix('msg_')}_{position}"


def tool_input(arguments: Any) -> dict[str, Any]:
    """A call's JSON arguments as the `input` object. Arguments that are not a JSON object (a model's
    broken output, or a cut-off stream) become `{}`: a tool_use `input` must be an object, and the tool
    then reports the missing arguments itself, which the model can act on."""
    if isinstance(arguments, dict):
        return arguments
    if not isinstance(arguments, str) or not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
