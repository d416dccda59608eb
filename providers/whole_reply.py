"""Upstreams that do not stream: a whole chat reply replayed as the stream its caller asked for (pure).

Some OpenAI-compatible servers ignore `stream` and answer with one JSON body; others refuse
`stream_options`, or `stream` itself, with a 400. Their answers are still answers: `replay_chunks`
turns a `chat.completion` into the `chat.completion.chunk` events an OpenAI upstream would have sent
(role, content, tool calls, finish reason, the usage chunk when the caller asked for it, `[DONE]`), so a
streaming caller (a relayed stream, early release of a merged call) reads it like any other stream.
`streaming_refusal` reads which of the two fields an upstream's 400 refused; `StreamSupport` is what a
provider remembers of it, so it stops asking. `ProviderStream` is a provider's stream that says when it
replays a whole reply (the pools then allow its first chunk the whole generation's time).
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from mergebroker.errors import UpstreamHTTPError

DONE = b"data: [DONE]\n\n"
_META_KEYS = ("id", "created", "model", "system_fingerprint", "service_tier")
_STREAM_OPTIONS = re.compile(r"stream_options", re.I)
_STREAM = re.compile(r"(?<!\w)stream(?:ing)?(?!\w)", re.I)  # `stream` or streaming, not `upstream`
_REFUSING_STATUSES = (400, 422)  # 422: validating servers (FastAPI and the like) refusing an unknown field


class StreamSupport(enum.Enum):
    """What one upstream accepts of a streaming request, as learnt from its answers (it only ever narrows)."""

    FULL = "full"  # `stream` and `stream_options`
    WITHOUT_OPTIONS = "without_options"  # `stream`, but a 400 for `stream_options`
    NONE = "none"  # answers streamed requests whole, or refuses `stream`: ask for a plain reply


def streaming_refusal(exc: UpstreamHTTPError, sent: Mapping[str, Any]) -> StreamSupport | None:
    """What an upstream's refusal of the streaming request `sent` says it supports, or None when the
    error is about something else.

    A 400 (or 422) naming `stream_options` means it streams without them; one naming `stream` means it
    does not stream. A refusal naming `stream_options` when none were sent is read as a refusal of `stream`,
    so a second try never repeats the first.
    """
    if exc.upstream_status not in _REFUSING_STATUSES:
        return None
    text = f"{exc.param or ''} {exc.message} {_dumps(exc.upstream_body)}"
    if _STREAM_OPTIONS.search(text):
        return StreamSupport.WITHOUT_OPTIONS if "stream_options" in sent else StreamSupport.NONE
    if _STREAM.search(text):
        return StreamSupport.NONE
    return None


def plain_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """The body of a streaming request as a plain call: without `stream` and `stream_options`."""
    return {k: v for k, v in body.items() if k not in ("stream", "stream_options")}


def replay_chunks(reply: Mapping[str, Any], *, include_usage: bool) -> list[bytes]:
    """The SSE events an OpenAI upstream would have streamed for the whole `reply` (a `chat.completion`).

    Per choice: a role chunk, its content, refusal and tool calls (each call whole, with its index, id
    and name), and its finish chunk; then the usage chunk when `include_usage` (every other chunk then
    carries `"usage": null`, as OpenAI sends them); then `[DONE]`.
    """
    meta = {k: reply[k] for k in _META_KEYS if reply.get(k) is not None}
    extra: dict[str, Any] = {"usage": None} if include_usage else {}

    def chunk(choices: list[dict[str, Any]], **fields: Any) -> bytes:
        payload = {**meta, "object": "chat.completion.chunk", "choices": choices, **extra, **fields}
        return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

    out = []
    for position, choice in enumerate(c for c in reply.get("choices") or [] if isinstance(c, dict)):
        index = choice.get("index", position)
        out += [chunk([{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}])
                for delta in _deltas(choice.get("message"))]
        out.append(chunk([{"index": index, "delta": {}, "logprobs": None,
                           "finish_reason": choice.get("finish_reason") or "stop"}]))
    if include_usage:
        out.append(chunk([], usage=reply.get("usage")))
    return out + [DONE]


class ProviderStream:
    """A provider's stream of SSE events that says whether it replays a whole reply.

    `whole_reply` is the `chat.completion` once the upstream answered whole (None while it streams): the
    pools then know its first chunk waited for the whole generation, which is expected, not slow.
    `open_events` builds the events, given this stream to note the reply on.
    """

    def __init__(self, open_events: Callable[[ProviderStream], AsyncIterator[bytes]]) -> None:
        self.whole_reply: dict[str, Any] | None = None
        self._events = open_events(self)

    def __aiter__(self) -> ProviderStream:
        return self

    async def __anext__(self) -> bytes:
        return await self._events.__anext__()

    async def aclose(self) -> None:
        """End the stream early (its connection is given back now)."""
        await self._events.aclose()  # type: ignore[attr-defined]


def _deltas(message: Any) -> list[dict[str, Any]]:
    """The deltas that stream one message: role first, then content, refusal and tool calls as present."""
    message = message if isinstance(message, dict) else {}
    deltas: list[dict[str, Any]] = [{"role": message.get("role") or "assistant", "content": ""}]
    if isinstance(message.get("content"), str) and message["content"]:
        deltas.append({"content": message["content"]})
    if isinstance(message.get("refusal"), str) and message["refusal"]:
        deltas.append({"refusal": message["refusal"]})
    calls = [c for c in message.get("tool_calls") or [] if isinstance(c, dict)]
    if calls:
        deltas.append({"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]})
    return deltas


def _dumps(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return ""
