"""The chat route as an agent's model (pure): tool calls, answers from tool results, and structured output.

The rules of `providers.simulator.agent`, in chat completions' shapes, so that a chat-only upstream serves an
agent whose calls a broker translated (Codex CLI's Responses calls, Claude Code's Messages calls):
- the conversation ends in `tool` messages: the answer quotes their results (`agent.after_tools`);
- `response_format` json_schema / json_object: JSON of the schema's shape (`agent.instance`);
- function `tools` and a conversation ending in a user message: `tool_calls` (finish_reason "tool_calls"),
  following `tool_choice` (`none`, `auto`, `required`, a named function) and `parallel_tool_calls`.
Anything else is not an agent's turn: `agent_reply` gives None and the usual answer (`content.compose_reply`)
is given.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from mergebroker.providers.simulator.agent import after_tools, instance, tool_calls
from mergebroker.providers.simulator.content import (
    Reply,
    answer_for,
    count_tokens,
    cut_to_tokens,
    message_text,
    question_text,
)
from mergebroker.providers.simulator.faults import DEFAULT_ANSWER_WORDS


def _results(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """The contents of the `tool` messages that end the conversation."""
    results: list[str] = []
    for message in reversed(messages):
        if message.get("role") != "tool":
            break
        results.append(message_text(message.get("content")))
    return results[::-1]


def _choice(choice: Any) -> tuple[str, str | None]:
    if choice == "none":
        return "none", None
    if choice == "required":
        return "any", None
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        return "tool", choice["function"].get("name")
    return "auto", None


def _text(text: str, max_tokens: int | None) -> Reply:
    content, tokens, cut = cut_to_tokens(text, max_tokens)
    return Reply(content, "length" if cut else "stop", tokens, False)


def agent_reply(body: Mapping[str, Any], messages: Sequence[Mapping[str, Any]], *, max_tokens: int | None,
                words: int = DEFAULT_ANSWER_WORDS) -> Reply | None:
    """The agent's reply to a chat call, or None when the call is not an agent's turn (see the module docstring)."""
    question = question_text(messages)
    results = _results(messages)
    if results:
        return _text(after_tools(results), max_tokens)
    given = body.get("response_format")
    fmt: dict[str, Any] = given if isinstance(given, dict) else {}
    spec = fmt.get("json_schema")
    if fmt.get("type") == "json_schema" and isinstance(spec, dict):
        return _text(json.dumps(instance(spec.get("schema") or {}, question)), max_tokens)
    if fmt.get("type") == "json_object":
        return _text(json.dumps({"answer": answer_for(question, words)}), max_tokens)
    listed = body.get("tools")
    offered: list[Any] = listed if isinstance(listed, list) else []
    tools = [{"name": t["function"]["name"], "schema": t["function"].get("parameters")}
             for t in offered if isinstance(t, dict) and t.get("type") == "function"
             and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)]
    if not tools or messages[-1].get("role") != "user":
        return None
    choice, named = _choice(body.get("tool_choice"))
    calls = tool_calls(tools, choice, named=named, parallel=body.get("parallel_tool_calls") is not False,
                       seed=question)
    if not calls:
        return None
    made: tuple[dict[str, Any], ...] = tuple({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                  "function": {"name": name, "arguments": json.dumps(value)}} for name, value in calls)
    tokens = sum(count_tokens(call["function"]["arguments"]) for call in made)
    return Reply("", "tool_calls", tokens, False, tool_calls=made)
