"""The OpenAI Responses API (`POST /v1/responses`) translated to and from Chat Completions (pure).

`parse_request` checks a create body into a `ResponsesRequest`; `input_items` lists its input for the
response store; `to_chat` builds the chat body (`ChatTranslation`), `from_chat` the Response for a chat
reply, and `ResponsesStream` the Responses event stream for a chat stream. For upstreams that speak
Responses natively, `completed_response` and `stream_usage` read the final frame of their stream.
Nothing here does I/O.
"""

from __future__ import annotations

from typing import Any

from mergebroker.broker.engine.apis.responses import items as _items
from mergebroker.broker.engine.apis.responses.native import completed_response, stream_usage
from mergebroker.broker.engine.apis.responses.reply import from_chat
from mergebroker.broker.engine.apis.responses.request import ResponsesRequest, parse_request
from mergebroker.broker.engine.apis.responses.stream import ResponsesStream
from mergebroker.broker.engine.apis.responses.tools import ToolNames, flat_name
from mergebroker.broker.engine.apis.responses.translate import ChatTranslation, to_chat


def input_items(request: ResponsesRequest, *, response_id: str) -> list[dict[str, Any]]:
    """The request's input as items with ids (derived from `response_id` where missing), a `status`, and
    messages' content as arrays of parts: what `GET /v1/responses/{id}/input_items` lists."""
    return _items.listed_items(request.input, response_id=response_id)


__all__ = ["ChatTranslation", "ResponsesRequest", "ResponsesStream", "ToolNames", "completed_response",
           "flat_name", "from_chat", "input_items", "parse_request", "stream_usage", "to_chat"]
