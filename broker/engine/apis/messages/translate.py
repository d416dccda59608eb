"""A Messages request as the Chat Completions body the engine runs (pure).

`system` becomes the first system message, then the turns (see `turns`). Parameters chat shares keep
their meaning under chat's names (`stop_sequences` -> `stop`, `metadata.user_id` -> `user`,
`tool_choice.disable_parallel_tool_use` -> `parallel_tool_calls: false`). What chat cannot carry
(`top_k`, `context_management`, `container`, `mcp_servers`, `service_tier`, thinking blocks of earlier
turns, and any field this module does not know) is left out and named in `dropped`; so are Anthropic's own
tools. A `thinking` config becomes `reasoning_effort` by its budget (kept only for models that take it, see
`inbound.portable`); one of type "disabled" changes nothing. The model is sent as the caller named it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mergebroker.broker.engine.apis.messages.content import system_text
from mergebroker.broker.engine.apis.messages.request import (
    MessagesRequest,
    thinking_enabled,
)
from mergebroker.broker.engine.apis.messages.tools import chat_tool_choice, chat_tools
from mergebroker.broker.engine.apis.messages.turns import chat_messages

# Same name, same meaning in both APIs (`broker` is the broker's own options, passed on as they came).
_SHARED = ("temperature", "top_p", "broker")
# Read by `to_chat` itself: never named as dropped.
_TRANSLATED = frozenset(("model", "messages", "system", "max_tokens", "tools", "tool_choice", "stop_sequences",
                         "stream", "metadata", "thinking", *_SHARED))


@dataclass(frozen=True)
class ChatTranslation:
    """The chat body for a Messages request, and what could not cross (`dropped`: `thinking`, `top_k`,
    `tools.web_search`...), each name once, in the order met."""

    body: dict[str, Any]
    dropped: tuple[str, ...]


def to_chat(request: MessagesRequest) -> ChatTranslation:
    """The Chat Completions body for `request`. A streamed request asks for usage in the stream's last chunk
    (`stream_options.include_usage`), which the Messages stream reports in its `message_delta`."""
    raw = request.body
    dropped: list[str] = []
    system = system_text(raw.get("system"))
    messages = [{"role": "system", "content": system}] if system else []
    messages += chat_messages(raw["messages"], dropped)
    body: dict[str, Any] = {"model": request.model, "messages": messages}
    _tools(raw, body, dropped)
    if request.max_tokens is not None:
        body["max_tokens"] = request.max_tokens
    body.update({name: raw[name] for name in _SHARED if raw.get(name) is not None})
    if raw.get("stop_sequences"):
        body["stop"] = list(raw["stop_sequences"])
    user = (raw.get("metadata") or {}).get("user_id")
    if isinstance(user, str) and user:
        body["user"] = user
    if thinking_enabled(raw):  # kept by the broker's chat form only for models that take it (inbound.portable)
        body["reasoning_effort"] = reasoning_effort(raw["thinking"])
    dropped += [name for name, value in raw.items() if name not in _TRANSLATED and value is not None]
    if request.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return ChatTranslation(body, tuple(dict.fromkeys(dropped)))


def reasoning_effort(thinking: dict[str, Any]) -> str:
    """The chat `reasoning_effort` closest to a thinking config: by its token budget (adaptive: medium)."""
    budget = thinking.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool):
        return "medium"
    return "low" if budget < 4096 else ("medium" if budget < 16384 else "high")


def _tools(raw: dict[str, Any], body: dict[str, Any], dropped: list[str]) -> None:
    tools = chat_tools(raw.get("tools"))
    dropped += tools.dropped
    if tools.tools:
        body["tools"] = list(tools.tools)
    choice, choice_dropped = chat_tool_choice(raw.get("tool_choice"), tools.names)
    dropped += choice_dropped
    if choice is not None:
        body["tool_choice"] = choice
    if tools.tools and (raw.get("tool_choice") or {}).get("disable_parallel_tool_use") is True:
        body["parallel_tool_calls"] = False
