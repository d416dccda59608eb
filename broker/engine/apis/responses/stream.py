"""A Chat Completions stream as the Responses event stream (pure: chunks in, SSE frames out).

`start` opens the response (`response.created`, `response.in_progress`); `feed` turns each parsed
`chat.completion.chunk` into events. Reasoning text (`reasoning_content` or `reasoning`) fills a
`reasoning` item (`response.reasoning_text.delta`); the first answer text opens a `message` item and its
`output_text` part before its `response.output_text.delta`; each tool call (by its chat `index`) opens a
`function_call` item that `response.function_call_arguments.delta` events fill. A text item closes when
the next item starts; tool calls stay open to the end, since a provider may interleave their arguments.
`finish` closes what is open and ends with `response.completed` (or `response.incomplete`) carrying the
whole Response, the same object `from_chat` builds for the equivalent reply; `fail` ends with
`response.failed`. Every event has a `sequence_number` counting from 0.
"""

from __future__ import annotations

from typing import Any

from mergebroker.broker.engine.apis.responses.items import item_id
from mergebroker.broker.engine.apis.responses.reply import (
    ID_PREFIX,
    call_item,
    reasoning_text,
    response_object,
    text_item,
    text_part,
)
from mergebroker.broker.engine.apis.responses.request import ResponsesRequest
from mergebroker.broker.engine.apis.responses.translate import ChatTranslation
from mergebroker.jsonio import dumps
from mergebroker.token_usage import NO_USAGE, TokenUsage

_TEXT_EVENTS = {"message": "response.output_text", "reasoning": "response.reasoning_text"}
_LOGPROBS: dict[str, dict[str, Any]] = {"message": {"logprobs": []}, "reasoning": {}}
# The SDK's `ResponseError.code` is a closed set; a code outside it is reported as the nearest of these.
_ERROR_CODES = frozenset(("server_error", "rate_limit_exceeded", "invalid_prompt", "vector_store_timeout",
                          "invalid_image", "invalid_image_format", "invalid_base64_image", "invalid_image_url",
                          "image_too_large", "image_too_small", "image_parse_error", "image_content_policy_violation",
                          "invalid_image_mode", "image_file_too_large", "unsupported_image_media_type",
                          "empty_image_file", "failed_to_download_image", "image_file_not_found"))


class ResponsesStream:
    """One response's events, built from the chat chunks of its answer."""

    def __init__(self, request: ResponsesRequest, translation: ChatTranslation, *, response_id: str,
                 created_at: int, previous_response_id: str | None = None) -> None:
        self._request, self._names = request, translation.tool_names
        self._id, self._created_at, self._previous = response_id, created_at, previous_response_id
        self._sequence = 0
        self._model = request.model
        self._output: list[dict[str, Any]] = []
        self._text: list[str] | None = None
        self._text_kind = "message"
        self._text_index = -1
        self._calls: dict[int, int] = {}
        self._finish_reason: str | None = None
        self._usage: TokenUsage | None = None
        self._final: dict[str, Any] | None = None

    @property
    def final_response(self) -> dict[str, Any] | None:
        """The whole Response once `finish` or `fail` has run (for the response store); None before."""
        return self._final

    def start(self) -> list[bytes]:
        """`response.created` and `response.in_progress`, each with the response as it starts."""
        response = self._response([], status="in_progress", usage=None)
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        """The events for one parsed chat chunk (none for a chunk without text, calls or an ending)."""
        if self._final is not None:
            return []
        self._model = chunk.get("model") or self._model
        usage = TokenUsage.from_body(chunk) if chunk.get("usage") else None
        self._usage = usage or self._usage
        frames: list[bytes] = []
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            for kind, text in (("reasoning", reasoning_text(delta)), ("message", delta.get("content"))):
                if isinstance(text, str) and text:
                    frames += self._text_delta(kind, text)
            for position, call in enumerate(delta.get("tool_calls") or ()):
                frames += self._call_delta(call, position)
            self._finish_reason = choice.get("finish_reason") or self._finish_reason
        return frames

    def finish(self, usage: TokenUsage | None = None) -> list[bytes]:
        """Close what is open and end with the whole Response. `usage` defaults to what the stream's last
        chunk reported (zeros when none did)."""
        if self._final is not None:
            return []
        usage = usage or self._usage or NO_USAGE
        final = self._response(self._snapshot("completed"), usage=usage)
        frames = self._close_text(final) + self._close_calls(final)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        self._final = final
        return frames + [self._event(kind, response=final)]

    def fail(self, status: int, code: str | None, message: str) -> list[bytes]:
        """End with `response.failed`: the upstream (HTTP `status`, its error `code`) gave up mid-answer."""
        if self._final is not None:
            return []
        if code not in _ERROR_CODES:
            code = "rate_limit_exceeded" if status == 429 else "server_error"
        self._final = self._response(self._snapshot("incomplete"), status="failed", usage=self._usage,
                                     error={"code": code, "message": message})
        return [self._event("response.failed", response=self._final)]

    def _text_delta(self, kind: str, text: str) -> list[bytes]:
        """Text of a `message` or `reasoning` item: reasoning ends where the answer's text begins."""
        frames = [] if self._text is not None and self._text_kind == kind else self._close_text(None)
        if self._text is None:
            self._text, self._text_kind, self._text_index = [], kind, len(self._output)
            item = {**text_item(kind, item_id(ID_PREFIX[kind], self._id, self._text_index), "", "in_progress"),
                    "content": []}
            self._output.append(item)
            frames.append(self._event("response.output_item.added", output_index=self._text_index, item=item))
            frames.append(self._event("response.content_part.added", **self._part_place(), part=text_part(kind, "")))
        self._text.append(text)
        return frames + [self._event(f"{_TEXT_EVENTS[kind]}.delta", **self._part_place(), delta=text,
                                     **_LOGPROBS[kind])]

    def _call_delta(self, call: dict[str, Any], position: int) -> list[bytes]:
        index = call.get("index", position)
        function = call.get("function") or {}
        frames = []
        if index not in self._calls:
            frames += self._close_text(None)
            place = len(self._output)
            self._calls[index] = place
            item = call_item(item_id("fc", self._id, place), call.get("id") or item_id("call", self._id, place),
                             function.get("name") or "", "", self._names, "in_progress")
            self._output.append(item)
            frames.append(self._event("response.output_item.added", output_index=place, item=dict(item)))
        place = self._calls[index]
        item = self._output[place]
        if function.get("name") and not item["name"]:
            self._output[place] = item = call_item(item["id"], item["call_id"], function["name"], item["arguments"],
                                                   self._names, "in_progress")
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            frames.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=place, delta=function["arguments"]))
        return frames

    def _close_text(self, final: dict[str, Any] | None) -> list[bytes]:
        """Close the open text item; `final` (the ending Response) gives its status, else it is complete."""
        if self._text is None:
            return []
        text, index, kind = "".join(self._text), self._text_index, self._text_kind
        self._text = None
        status = final["output"][index]["status"] if final else "completed"
        item = text_item(kind, self._output[index]["id"], text, status)
        self._output[index] = item
        if final is not None:
            final["output"][index] = item
        part = item["content"][0]
        return [self._event(f"{_TEXT_EVENTS[kind]}.done", **self._part_place(index), text=text, **_LOGPROBS[kind]),
                self._event("response.content_part.done", **self._part_place(index), part=part),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _close_calls(self, final: dict[str, Any]) -> list[bytes]:
        frames = []
        for place in sorted(self._calls.values()):
            item = final["output"][place]
            frames.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=place, arguments=item["arguments"]))
            frames.append(self._event("response.output_item.done", output_index=place, item=item))
        return frames

    def _part_place(self, index: int | None = None) -> dict[str, Any]:
        index = self._text_index if index is None else index
        return {"item_id": self._output[index]["id"], "output_index": index, "content_index": 0}

    def _snapshot(self, status: str) -> list[dict[str, Any]]:
        """The output items as they stand, each with `status`, the open text item holding its text so far."""
        output = [{**item, "status": status} for item in self._output]
        if self._text is not None:
            output[self._text_index] = text_item(self._text_kind, output[self._text_index]["id"], "".join(self._text),
                                                 status)
        return output

    def _response(self, output: list[dict[str, Any]], *, usage: TokenUsage | None, status: str | None = None,
                  error: dict[str, Any] | None = None) -> dict[str, Any]:
        return response_object(self._request, response_id=self._id, created_at=self._created_at, model=self._model,
                               output=output, finish_reason=self._finish_reason if status is None else None,
                               usage=usage, previous_response_id=self._previous, status=status, error=error)

    def _event(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + dumps(event) + b"\n\n"
