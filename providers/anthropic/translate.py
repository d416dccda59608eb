"""OpenAI chat-completions requests as Anthropic Messages requests (version 2023-06-01), or a refusal (pure).

`to_messages` builds the Messages body and says how to read its reply (`MessagesCall`), or refuses a
field the Messages API cannot carry with `UpstreamUnsupported` naming it (a 400 before anything is
sent). The parts live beside it: turns (`anthropic_turns`), content and images (`anthropic_content`,
`anthropic_images`), tools (`anthropic_tools`), structured output (`anthropic_structured`). The reply
side is `anthropic_reply` (a Message) and `anthropic_stream` (its stream); errors, `anthropic_errors`.
Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mergebroker.combined_header import split_combined_header
from mergebroker.output_budget import token_budget
from mergebroker.providers.anthropic.refuse import refuse
from mergebroker.providers.anthropic.structured import NATIVE_STRUCTURED_OUTPUT, ReplyShape, to_output
from mergebroker.providers.anthropic.tools import to_tool_choice, to_tools
from mergebroker.providers.anthropic.turns import split_messages

ANTHROPIC_VERSION = "2023-06-01"

_PASS_THROUGH = ("temperature", "top_p", "top_k")
_CONSUMED = frozenset({"model", "messages", "max_tokens", "max_completion_tokens", "stop", "stream",
                       "stream_options", "user", "safety_identifier", "prompt_cache_key", "tools", "tool_choice",
                       "parallel_tool_calls", "response_format", *_PASS_THROUGH})
"""Fields translated, or (`prompt_cache_key`, a hint for OpenAI's own prompt cache) safe to leave behind."""
_NEUTRAL: dict[str, Any] = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0, "logprobs": False,
                            "store": False}
"""Fields accepted only at the value that asks for nothing (SDKs sometimes send these defaults)."""

_REASONS: dict[str, str] = {
    "n": "Anthropic returns one choice per call",
    "functions": "legacy function calling is not translated (use tools)",
    "function_call": "legacy function calling is not translated (use tool_choice)",
    "seed": "Anthropic has no seeded sampling",
    "logprobs": "Anthropic returns no log probabilities", "top_logprobs": "Anthropic returns no log probabilities",
    "logit_bias": "Anthropic has no logit bias", "presence_penalty": "Anthropic has no presence penalty",
    "frequency_penalty": "Anthropic has no frequency penalty", "audio": "Anthropic does not answer with audio",
    "modalities": "Anthropic answers with text only",
}


@dataclass(frozen=True)
class MessagesCall:
    """A Messages API request body, and how its reply is to be read (`anthropic_reply`, `anthropic_stream`)."""

    body: dict[str, Any]
    shape: ReplyShape = ReplyShape()


def _absent(name: str, value: Any) -> bool:
    """Whether a field asks for nothing: null, empty, or its neutral value."""
    if value is None or value == {} or value == []:
        return True
    if name == "modalities":
        return value == ["text"]
    return name in _NEUTRAL and value == _NEUTRAL[name] and type(value) is type(_NEUTRAL[name])


def _check_fields(body: Mapping[str, Any]) -> None:
    for name, value in body.items():
        if name in _CONSUMED or _absent(name, value):
            continue
        raise refuse(name, _REASONS.get(name, "the Messages API has no such field"))
    temperature = body.get("temperature")
    if isinstance(temperature, (int, float)) and temperature > 1:
        raise refuse("temperature", "Anthropic's range is 0 to 1")


def _stop_sequences(stop: Any) -> list[str]:
    """`stop` as `stop_sequences`; the Messages API refuses a sequence without a visible character."""
    sequences = [stop] if isinstance(stop, str) else list(stop)
    for sequence in sequences:
        if not sequence.strip():
            raise refuse("stop", f"Anthropic refuses stop sequences made only of whitespace ({sequence!r})")
    return sequences


def _tooling(body: Mapping[str, Any], model: str, native: Sequence[str]) -> tuple[dict[str, Any], ReplyShape]:
    """The `tools`, `tool_choice` and `output_config` fields, and how to read the reply."""
    tools = to_tools(body["tools"]) if body.get("tools") else []
    out: dict[str, Any] = {"tools": tools} if tools else {}
    choice = to_tool_choice(body.get("tool_choice"), parallel=body.get("parallel_tool_calls"), has_tools=bool(tools))
    if choice is not None:
        out["tool_choice"] = choice
    output, shape = to_output(body.get("response_format"), model=model, has_tools=bool(tools), native=native)
    return {**out, **output}, shape


def to_messages(body: Mapping[str, Any], *, default_max_tokens: int, model_map: Mapping[str, str] | None = None,
                native_structured_output: Sequence[str] = NATIVE_STRUCTURED_OUTPUT) -> MessagesCall:
    """The Messages API call for an OpenAI chat-completions `body` (without `stream`; the caller sets it).

    System and developer messages become `system` (joined by blank lines, in order); the rest become
    alternating turns (`anthropic_turns`); `max_tokens` (or `max_completion_tokens`, the smaller of both)
    defaults to `default_max_tokens`, because the Messages API requires one; `stop` becomes
    `stop_sequences`; `user` (or `safety_identifier`) becomes `metadata.user_id`; temperature, top_p and
    top_k pass through when set (never added: models from Opus 4.7 on refuse any sampling field, and their
    400 names it); tools and `response_format` as their modules say, structured output natively for the
    models matching `native_structured_output`. `model_map` renames the model. A long system prompt ends
    with a cache breakpoint (`with_system_breakpoint`). Raises `UpstreamUnsupported` naming the first field
    that cannot be carried.
    """
    _check_fields(body)
    system, turns = split_messages(body.get("messages"))
    model = str(body.get("model") or "")
    model = (model_map or {}).get(model, model)
    out: dict[str, Any] = {"model": model, "messages": turns, "max_tokens": token_budget(body, default_max_tokens)}
    if system:
        out["system"] = "\n\n".join(system)
    if body.get("stop"):
        out["stop_sequences"] = _stop_sequences(body["stop"])
    for name in _PASS_THROUGH:
        if body.get(name) is not None:
            out[name] = body[name]
    user = body.get("user") or body.get("safety_identifier")
    if user:
        out["metadata"] = {"user_id": str(user)}
    tooling, shape = _tooling(body, model, native_structured_output)
    return MessagesCall(with_system_breakpoint({**out, **tooling}), shape)


MAX_BREAKPOINTS = 4
"""Anthropic refuses a request with more `cache_control` blocks than this."""
CHARS_PER_TOKEN = 3
"""A generous tokens-per-character guess (English runs nearer 4): a prefix that might reach the minimum gets
its breakpoint, since one below the minimum costs nothing (Anthropic neither reads nor writes it)."""


def min_cacheable_tokens(model: str) -> int:
    """Anthropic's shortest cacheable prefix for `model`: 2,048 tokens for Haiku models, else 1,024 (the figures
    `merge.prompt_cache` models; providers may not import it)."""
    return 2048 if "haiku" in model.lower() else 1024


def with_system_breakpoint(body: dict[str, Any]) -> dict[str, Any]:
    """`body` with its system prompt sent as a text block marked `cache_control: ephemeral`, so that the calls
    sharing it (a merged call and its members alone, or consecutive merged calls) read it from Anthropic's
    cache; unchanged when there is no system prompt, when tools and system prompt cannot reach the model's
    minimum cacheable length, or when the body already holds `MAX_BREAKPOINTS` breakpoints.

    Every call gets it, not only merged ones: the broker's cost model (`engine.accounting.costs`) assumes
    this breakpoint for calls sent alone. A merged call gets a second one after its header, at the start of
    its user turn (`mergebroker.combined_header.split_combined_header`): the header is the same in every merged call, so
    system prompt and header are read from cache together, as the merge's cost model counts them.
    """
    system = body.get("system")
    if not isinstance(system, str) or not system or _breakpoints(body) >= MAX_BREAKPOINTS:
        return body
    prefix_chars = len(system) + sum(len(json.dumps(t)) for t in body.get("tools") or [])
    if prefix_chars < min_cacheable_tokens(str(body.get("model") or "")) * CHARS_PER_TOKEN:
        return body
    marked = {**body, "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]}
    return _with_header_breakpoint(marked)


def _with_header_breakpoint(body: dict[str, Any]) -> dict[str, Any]:
    """A merged call's first user turn as two text blocks, the header's marked `cache_control`."""
    turns = body.get("messages") or []
    first = turns[0] if turns else None
    if not isinstance(first, dict) or first.get("role") != "user" or _breakpoints(body) >= MAX_BREAKPOINTS:
        return body
    content = first.get("content")
    text = content if isinstance(content, str) else (
        content[0].get("text") if isinstance(content, list) and len(content) == 1 and isinstance(content[0], dict)
        and content[0].get("type") == "text" and "cache_control" not in content[0] else None)
    split = split_combined_header(text) if isinstance(text, str) else None
    if split is None:
        return body
    header, blocks = split
    marked = {**first, "content": [{"type": "text", "text": header, "cache_control": {"type": "ephemeral"}},
                                   {"type": "text", "text": blocks}]}
    return {**body, "messages": [marked, *turns[1:]]}


def _breakpoints(value: Any) -> int:
    """How many blocks of a Messages body carry `cache_control`."""
    if isinstance(value, dict):
        return int("cache_control" in value) + sum(_breakpoints(v) for k, v in value.items() if k != "cache_control")
    if isinstance(value, list):
        return sum(_breakpoints(v) for v in value)
    return 0
