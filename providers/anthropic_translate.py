"""Pure translation between OpenAI chat completions and Anthropic's Messages API (version 2023-06-01).

Requests: `to_messages` turns a chat-completions body into a Messages body, or refuses a field the
Messages API cannot carry with `UpstreamUnsupported` naming it (a 400 before anything is sent).
Answers: `to_completion` turns a Message into a `chat.completion`; `StreamTranslator` turns the
Messages SSE events into `chat.completion.chunk` events ending in `data: [DONE]`, so callers (the
broker's stream relay, early release of merged answers) see exactly what an OpenAI upstream sends.
Errors: `to_error` maps Anthropic's error envelope and statuses (529 `overloaded_error` included) onto
`UpstreamHTTPError`. Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from mergebroker.errors import UpstreamBadResponse, UpstreamHTTPError, UpstreamUnsupported

ANTHROPIC_VERSION = "2023-06-01"
OVERLOADED_STATUS = 529
OVERLOADED_RETRY_AFTER_S = 1.0
"""Suggested wait after a 529 that named none: overload clears in seconds, and a retry at once only adds to it."""

FINISH_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length",
                  "model_context_window_exceeded": "length", "tool_use": "tool_calls",
                  "refusal": "content_filter", "pause_turn": "stop"}
"""Anthropic `stop_reason` -> OpenAI `finish_reason` (an unknown or missing reason counts as "stop")."""

ERROR_TYPES = {"invalid_request_error": "invalid_request_error", "not_found_error": "invalid_request_error",
               "request_too_large": "invalid_request_error", "rate_limit_error": "rate_limit_error",
               "authentication_error": "invalid_request_error", "permission_error": "permission_error",
               "billing_error": "invalid_request_error", "timeout_error": "timeout_error",
               "api_error": "server_error", "overloaded_error": "server_error"}
"""Anthropic error `type` -> OpenAI error `type`; Anthropic's own type travels on as the error's `code`."""

_STREAM_ERROR_STATUS = {"overloaded_error": OVERLOADED_STATUS, "rate_limit_error": 429, "api_error": 500,
                        "timeout_error": 504, "invalid_request_error": 400, "request_too_large": 413}

_PASS_THROUGH = ("temperature", "top_p", "top_k")
_CONSUMED = frozenset({"model", "messages", "max_tokens", "max_completion_tokens", "stop", "stream",
                       "stream_options", "user", "safety_identifier", "prompt_cache_key", *_PASS_THROUGH})
"""Fields translated, or (`prompt_cache_key`, a hint for OpenAI's own prompt cache) safe to leave behind."""
_NEUTRAL: dict[str, Any] = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0, "logprobs": False,
                            "store": False, "parallel_tool_calls": True}
"""Fields accepted only at the value that asks for nothing (SDKs sometimes send these defaults)."""

_REASONS: dict[str, str] = {
    "n": "Anthropic returns one choice per call",
    "tools": "tool calls are not translated", "tool_choice": "tool calls are not translated",
    "functions": "function calls are not translated", "function_call": "function calls are not translated",
    "parallel_tool_calls": "tool calls are not translated",
    "response_format": "Anthropic has no JSON mode", "seed": "Anthropic has no seeded sampling",
    "logprobs": "Anthropic returns no log probabilities", "top_logprobs": "Anthropic returns no log probabilities",
    "logit_bias": "Anthropic has no logit bias", "presence_penalty": "Anthropic has no presence penalty",
    "frequency_penalty": "Anthropic has no frequency penalty",
}


def refuse(param: str, why: str) -> UpstreamUnsupported:
    """The 400 for a request field this protocol cannot carry (the broker refuses it rather than drop it)."""
    return UpstreamUnsupported(f"'{param}' is not supported by an Anthropic upstream: {why}.", param=param)


def _absent(name: str, value: Any) -> bool:
    """Whether a field asks for nothing: null, empty, or its neutral value."""
    if value is None or value == {} or value == []:
        return True
    if name == "response_format":
        return isinstance(value, dict) and value.get("type") == "text"
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


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content as Anthropic takes it: a string, or text blocks (other parts are refused)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise refuse(where, "each message needs text content")
    blocks = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise refuse(f"{where}[{j}].type", "only text parts are translated")
        blocks.append({"type": "text", "text": part["text"]})
    return blocks


def _text(content: str | list[dict[str, Any]]) -> str:
    return content if isinstance(content, str) else "\n".join(b["text"] for b in content)


def _split_messages(messages: Any) -> tuple[list[str], list[dict[str, Any]]]:
    """System texts (system and developer messages, in order) and the user/assistant turns."""
    if not isinstance(messages, list) or not messages:
        raise refuse("messages", "a non-empty list of messages is required")
    system: list[str] = []
    turns: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("system", "developer", "user", "assistant"):
            raise refuse(f"messages[{i}].role", f"role {role!r} (tool results) is not translated")
        extra = sorted(k for k in m if k not in ("role", "content") and m[k] is not None)
        if extra:
            raise refuse(f"messages[{i}].{extra[0]}", "only a message's role and text content are translated")
        content = _content(m.get("content"), f"messages[{i}].content")
        if role in ("system", "developer"):
            system.append(_text(content))
        else:
            turns.append({"role": role, "content": content})
    if not turns:
        raise refuse("messages", "Anthropic needs at least one user or assistant message")
    return system, turns


def to_messages(body: Mapping[str, Any], *, default_max_tokens: int,
                model_map: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The Messages API body for an OpenAI chat-completions `body` (without `stream`; the caller sets it).

    System and developer messages become `system` (joined by blank lines, in order); `max_tokens`
    (or `max_completion_tokens`, the smaller of both) defaults to `default_max_tokens`, because the
    Messages API requires one; `stop` becomes `stop_sequences`; `user` (or `safety_identifier`) becomes
    `metadata.user_id`; temperature, top_p and top_k pass through when set (never added: models from
    Opus 4.7 on refuse any sampling field, and their 400 names it). `model_map` renames the model. Raises
    `UpstreamUnsupported` naming the first field that cannot be carried.
    """
    _check_fields(body)
    system, turns = _split_messages(body.get("messages"))
    model = str(body.get("model") or "")
    limits = [body[k] for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None]
    out: dict[str, Any] = {"model": (model_map or {}).get(model, model), "messages": turns,
                           "max_tokens": min(limits, default=default_max_tokens)}
    if system:
        out["system"] = "\n\n".join(system)
    stop = body.get("stop")
    if stop:
        out["stop_sequences"] = [stop] if isinstance(stop, str) else list(stop)
    for name in _PASS_THROUGH:
        if body.get(name) is not None:
            out[name] = body[name]
    user = body.get("user") or body.get("safety_identifier")
    if user:
        out["metadata"] = {"user_id": str(user)}
    return out


def to_usage(usage: Mapping[str, Any] | None) -> dict[str, Any]:
    """OpenAI usage from Anthropic's: the prompt counts cache writes and reads too (all are input)."""
    usage = usage or {}
    cached = _count(usage.get("cache_read_input_tokens"))
    prompt = _count(usage.get("input_tokens")) + _count(usage.get("cache_creation_input_tokens")) + cached
    completion = _count(usage.get("output_tokens"))
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                           "total_tokens": prompt + completion}
    if cached:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def finish_reason(stop_reason: Any) -> str:
    """The OpenAI finish_reason of an Anthropic stop_reason."""
    return FINISH_REASONS.get(stop_reason, "stop") if isinstance(stop_reason, str) else "stop"


def to_completion(message: Mapping[str, Any], *, created: int) -> dict[str, Any]:
    """A `chat.completion` from a Message: its text blocks joined, stop reason and usage mapped."""
    blocks = message.get("content")
    if message.get("type") != "message" or not isinstance(blocks, list):
        raise UpstreamBadResponse("upstream Messages answer is not a message")
    text = "".join(b["text"] for b in blocks if isinstance(b, dict) and b.get("type") == "text"
                   and isinstance(b.get("text"), str))
    return {"id": str(message.get("id") or ""), "object": "chat.completion", "created": created,
            "model": str(message.get("model") or ""),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                         "logprobs": None, "finish_reason": finish_reason(message.get("stop_reason"))}],
            "usage": to_usage(message.get("usage"))}


def to_error(status: int, body: Any, *, retry_after: float | None) -> UpstreamHTTPError:
    """The `UpstreamHTTPError` for an Anthropic error answer (`{"type": "error", "error": {type, message}}`).

    400/404/413 stay the caller's fault and 401/403 the broker's credentials, as for any upstream;
    429 keeps its Retry-After; 529 `overloaded_error` is a retryable 503 whose Retry-After defaults to
    `OVERLOADED_RETRY_AFTER_S` when the upstream named none.
    """
    error = body.get("error") if isinstance(body, dict) else None
    kind = str(error.get("type") or "") if isinstance(error, dict) else ""
    message = error.get("message") if isinstance(error, dict) else None
    if not isinstance(message, str) or not message:
        message = f"upstream answered HTTP {status}"
    envelope = {"error": {"message": message, "type": ERROR_TYPES.get(kind, "invalid_request_error"),
                          "code": kind or None, "param": None}}
    overloaded = status == OVERLOADED_STATUS or kind == "overloaded_error"
    if overloaded and retry_after is None:
        retry_after = OVERLOADED_RETRY_AFTER_S
    exc = UpstreamHTTPError(status, message, retry_after=retry_after, body=envelope)
    if overloaded:
        exc.status, exc.type, exc.code = 503, "service_unavailable", "upstream_overloaded"
    return exc


def parse_sse(raw: bytes) -> tuple[str | None, str]:
    """The `event:` name and the joined `data:` lines of one SSE event."""
    name, data = None, []
    for line in raw.decode("utf-8", errors="replace").split("\n"):
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    return name, "\n".join(data)


def sse(payload: Mapping[str, Any]) -> bytes:
    """One OpenAI-style SSE event (`data: {json}` and a blank line)."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"
_SLOT = "\x00text\x00"  # stands for a chunk's text while its frame is rendered; JSON escapes it, no text holds it


@dataclass
class StreamTranslator:
    """Turns Anthropic stream events into `chat.completion.chunk` events, one `feed` per event.

    `message_start` gives the role chunk, text deltas give content chunks, `message_delta` records the
    stop reason and output tokens, and `message_stop` gives the finish chunk, the usage chunk when the
    caller asked for it (`stream_options.include_usage`) and `[DONE]`. An `error` event raises the
    mapped error. `done` tells whether `message_stop` arrived: a stream that ends without it was cut.
    """

    created: int
    include_usage: bool = False
    done: bool = False
    _meta: dict[str, Any] = field(default_factory=dict)
    _usage: dict[str, Any] = field(default_factory=dict)
    _stop_reason: Any = None
    _text_frame: tuple[bytes, bytes] = (b"", b"")

    def feed(self, raw: bytes) -> list[bytes]:
        """The OpenAI events for one raw Anthropic SSE event (often none: pings, block starts and stops)."""
        name, data = parse_sse(raw)
        if not data:
            return []
        try:
            event = json.loads(data)
        except ValueError:
            raise UpstreamBadResponse("upstream sent a stream event that is not JSON") from None
        kind = event.get("type", name) if isinstance(event, dict) else None
        handler = getattr(self, f"_on_{kind}", None) if isinstance(kind, str) else None
        return handler(event) if handler is not None else []  # unknown events may be added: skip them

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        usage = {"usage": None} if self.include_usage else {}
        return sse({**self._meta, "object": "chat.completion.chunk", "created": self.created,
                    "choices": choices, **usage, **extra})

    def _delta(self, delta: dict[str, Any], reason: str | None = None) -> bytes:
        return self._chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}])

    def _on_message_start(self, event: dict[str, Any]) -> list[bytes]:
        message = event.get("message") if isinstance(event.get("message"), dict) else {}
        self._meta = {"id": str(message.get("id") or ""), "model": str(message.get("model") or "")}
        self._usage.update(message.get("usage") or {})
        # Text chunks differ only in their text: render the rest once (a third of the cost per chunk).
        head, _, tail = self._delta({"content": _SLOT}).rpartition(json.dumps(_SLOT).encode())
        self._text_frame = (head, tail)
        return [self._delta({"role": "assistant", "content": ""})]

    def _text(self, text: Any) -> list[bytes]:
        if not isinstance(text, str) or not text:
            return []
        head, tail = self._text_frame
        return [head + json.dumps(text).encode() + tail] if head else [self._delta({"content": text})]

    def _on_content_block_start(self, event: dict[str, Any]) -> list[bytes]:
        block = event.get("content_block") or {}
        return self._text(block.get("text") if block.get("type") == "text" else None)

    def _on_content_block_delta(self, event: dict[str, Any]) -> list[bytes]:
        delta = event.get("delta") or {}
        return self._text(delta.get("text") if delta.get("type") == "text_delta" else None)

    def _on_message_delta(self, event: dict[str, Any]) -> list[bytes]:
        self._stop_reason = (event.get("delta") or {}).get("stop_reason", self._stop_reason)
        # Usage here is cumulative: it replaces the counts message_start gave.
        self._usage.update({k: v for k, v in (event.get("usage") or {}).items() if v is not None})
        return []

    def _on_message_stop(self, event: dict[str, Any]) -> list[bytes]:
        self.done = True
        out = [self._delta({}, finish_reason(self._stop_reason))]
        if self.include_usage:
            out.append(self._chunk([], usage=to_usage(self._usage)))
        return out + [DONE]

    def _on_error(self, event: dict[str, Any]) -> list[bytes]:
        error = event.get("error") if isinstance(event.get("error"), dict) else {}
        status = _STREAM_ERROR_STATUS.get(str(error.get("type")), 500)
        raise to_error(status, event, retry_after=None)
