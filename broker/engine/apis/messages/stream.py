"""A Chat Completions stream as the Anthropic Messages event stream (pure: chunks in, SSE frames out).

`start` opens the message (`message_start`, empty content, the broker's estimate of the prompt's tokens);
`feed` turns each parsed `chat.completion.chunk` into events. Reasoning text fills a `thinking` block when
the caller asked for thinking; answer text fills a `text` block; each tool call (by its chat `index`)
opens a `tool_use` block that `input_json_delta` events fill. One block is open at a time, as Anthropic
streams them (Claude Code takes a `content_block_stop` to end the last block started): a new block closes
the open one. `finish` closes the open block and ends with `message_delta` (stop reason, usage) and
`message_stop`; `fail` ends with an `error` event. Block indexes count from 0 in order.
"""

from __future__ import annotations

from typing import Any

from mergebroker.broker.engine.apis.messages.envelope import error_event, sse
from mergebroker.broker.engine.apis.messages.reply import (
    message_object,
    reasoning_text,
    stop_reason,
    thinking_block,
    tool_use_block,
    tool_use_id,
)
from mergebroker.broker.engine.apis.messages.request import MessagesRequest
from mergebroker.token_usage import TokenUsage


class MessagesStream:
    """One message's events, built from the chat chunks of its answer."""

    def __init__(self, request: MessagesRequest, *, message_id: str, prompt_tokens_estimate: int) -> None:
        self._request, self._id = request, message_id
        self._estimate = TokenUsage(prompt_tokens=max(0, prompt_tokens_estimate))
        self._model = request.model
        self._blocks = 0
        self._open: str | None = None
        self._calls: dict[int, int] = {}
        self._finish_reason: str | None = None
        self._usage: TokenUsage | None = None
        self._ended = False

    def start(self) -> list[bytes]:
        """`message_start`, its message empty, its usage the prompt's estimate (the real count comes last)."""
        message = message_object(self._id, self._model, [], None, self._estimate)
        return [sse("message_start", {"type": "message_start", "message": message})]

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        """The events for one parsed chat chunk (none for a chunk without text, calls or anything new)."""
        if self._ended:
            return []
        if chunk.get("usage"):
            self._usage = TokenUsage.from_body(chunk) or self._usage
        frames: list[bytes] = []
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                continue
            reasoning = reasoning_text(delta)
            if reasoning and self._request.thinking:
                frames += self._text_delta("thinking", reasoning)
            if isinstance(delta.get("content"), str) and delta["content"]:
                frames += self._text_delta("text", delta["content"])
            for position, call in enumerate(delta.get("tool_calls") or ()):
                if isinstance(call, dict):
                    frames += self._call_delta(call, position)
            self._finish_reason = choice.get("finish_reason") or self._finish_reason
        return frames

    def finish(self, usage: TokenUsage | None = None) -> list[bytes]:
        """Close the open block and end the message. `usage` defaults to what the stream's last chunk
        reported, and failing that to the prompt's estimate with no output counted."""
        if self._ended:
            return []
        self._ended = True
        # A Message always has content: an answer that said nothing still gets its empty text block.
        frames = self._open_block("text", {"type": "text", "text": ""}) if self._blocks == 0 else []
        frames += self._close()
        usage = usage or self._usage or self._estimate
        delta = {"stop_reason": stop_reason(self._finish_reason, has_calls=bool(self._calls)), "stop_sequence": None}
        return frames + [sse("message_delta", {"type": "message_delta", "delta": delta, "usage": usage.as_anthropic()}),
                         sse("message_stop", {"type": "message_stop"})]

    def fail(self, status: int, code: str | None, message: str) -> list[bytes]:
        """End with an `error` event: the upstream (HTTP `status`, its error `code`) gave up mid-answer.
        Nothing is closed first: Anthropic's own streams end on the error event alone."""
        if self._ended:
            return []
        self._ended = True
        return [error_event(status, code, message, None)]

    def _text_delta(self, kind: str, text: str) -> list[bytes]:
        frames = []
        if self._open != kind:
            start = thinking_block("") if kind == "thinking" else {"type": "text", "text": ""}
            frames = self._open_block(kind, start)
        if kind == "thinking":
            delta = {"type": "thinking_delta", "thinking": text}
        else:
            delta = {"type": "text_delta", "text": text}
        return frames + [self._delta(self._blocks - 1, delta)]

    def _call_delta(self, call: dict[str, Any], position: int) -> list[bytes]:
        index = call.get("index", position)
        found = call.get("function")
        function: dict[str, Any] = found if isinstance(found, dict) else {}
        frames = []
        if index not in self._calls:
            block = tool_use_block(call.get("id") or tool_use_id(self._id, self._blocks),
                                   function.get("name") or "", {})
            frames = self._open_block("tool_use", block)
            self._calls[index] = self._blocks - 1
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            # A provider interleaving two calls' arguments sends a fragment for a block already closed; it
            # still goes out under that block's index, which the SDKs' accumulators apply by index.
            frames.append(self._delta(self._calls[index], {"type": "input_json_delta", "partial_json": arguments}))
        return frames

    def _open_block(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        frames = self._close()
        self._open = kind
        self._blocks += 1
        return frames + [sse("content_block_start", {"type": "content_block_start", "index": self._blocks - 1,
                                                     "content_block": block})]

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        frames = []
        if self._open == "thinking":
            # Anthropic sends a thinking block's signature last; the SDKs expect one, even an empty one.
            frames.append(self._delta(self._blocks - 1, {"type": "signature_delta", "signature": ""}))
        self._open = None
        return frames + [sse("content_block_stop", {"type": "content_block_stop", "index": self._blocks - 1})]

    def _delta(self, index: int, delta: dict[str, Any]) -> bytes:
        return sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
