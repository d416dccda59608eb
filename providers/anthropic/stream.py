"""Anthropic's Messages stream as OpenAI `chat.completion.chunk` events ending in `data: [DONE]` (pure).

Callers (the broker's stream relay, early release of merged answers) then see exactly what an OpenAI
upstream sends: text deltas as `content`, and each `tool_use` block as one OpenAI tool call, its first
chunk carrying the call's index, id and name and its `input_json_delta`s the argument pieces. The input of
the forced structured-output tool (`ReplyShape.json_tool`) streams as `content` instead.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mergebroker.errors import UpstreamBadResponse
from mergebroker.providers.anthropic.errors import stream_error
from mergebroker.providers.anthropic.reply import finish_reason, to_usage
from mergebroker.providers.anthropic.structured import ReplyShape
from mergebroker.providers.anthropic.tools import arguments_json

DONE = b"data: [DONE]\n\n"
_SLOT = "\x00text\x00"  # stands for a chunk's text while its frame is rendered; JSON escapes it, no text holds it


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


@dataclass
class StreamTranslator:
    """Turns Anthropic stream events into `chat.completion.chunk` events, one `feed` per event.

    `message_start` gives the role chunk, text deltas give content chunks, a `tool_use` block start gives
    a tool call's first chunk and its `input_json_delta`s its argument chunks, `message_delta` records the
    stop reason and output tokens, and `message_stop` gives the finish chunk, the usage chunk when the
    caller asked for it (`stream_options.include_usage`) and `[DONE]`. An `error` event raises the
    mapped error. `done` tells whether `message_stop` arrived: a stream that ends without it was cut.
    """

    created: int
    include_usage: bool = False
    shape: ReplyShape = ReplyShape()
    done: bool = False
    _meta: dict[str, Any] = field(default_factory=dict)
    _usage: dict[str, Any] = field(default_factory=dict)
    _stop_reason: Any = None
    _text_frame: tuple[bytes, bytes] = (b"", b"")
    _calls: dict[int, int] = field(default_factory=dict)  # Anthropic block index -> OpenAI tool call index
    _answer_blocks: set[int] = field(default_factory=set)  # blocks of the forced tool: their input is the answer

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
        found = event.get("message")
        message: dict[str, Any] = found if isinstance(found, dict) else {}
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
        if block.get("type") == "text":
            return self._text(block.get("text"))
        if block.get("type") != "tool_use" or not isinstance(event.get("index"), int):
            return []
        given = block.get("input") or None  # some servers send the whole input here, not as deltas
        if block.get("name") == self.shape.json_tool:
            self._answer_blocks.add(event["index"])
            return self._text(arguments_json(given) if given else None)
        position = self._calls[event["index"]] = len(self._calls)
        call = {"index": position, "id": str(block.get("id") or ""), "type": "function",
                "function": {"name": str(block.get("name") or ""), "arguments": arguments_json(given) if given else ""}}
        return [self._delta({"tool_calls": [call]})]

    def _on_content_block_delta(self, event: dict[str, Any]) -> list[bytes]:
        delta = event.get("delta") or {}
        if delta.get("type") == "text_delta":
            return self._text(delta.get("text"))
        piece = delta.get("partial_json")
        if delta.get("type") != "input_json_delta" or not isinstance(piece, str) or not piece:
            return []
        if event.get("index") in self._answer_blocks:
            return self._text(piece)
        position = self._calls.get(event.get("index"))  # type: ignore[arg-type]
        if position is None:
            return []
        return [self._delta({"tool_calls": [{"index": position, "function": {"arguments": piece}}]})]

    def _on_message_delta(self, event: dict[str, Any]) -> list[bytes]:
        self._stop_reason = (event.get("delta") or {}).get("stop_reason", self._stop_reason)
        # Usage here is cumulative: it replaces the counts message_start gave.
        self._usage.update({k: v for k, v in (event.get("usage") or {}).items() if v is not None})
        return []

    def _on_message_stop(self, event: dict[str, Any]) -> list[bytes]:
        self.done = True
        out = [self._delta({}, finish_reason(self._stop_reason, self.shape))]
        if self.include_usage:
            out.append(self._chunk([], usage=to_usage(self._usage)))
        return out + [DONE]

    def _on_error(self, event: dict[str, Any]) -> list[bytes]:
        raise stream_error(event)
