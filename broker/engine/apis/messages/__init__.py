"""The Anthropic Messages API (`POST /v1/messages`) translated to and from Chat Completions (pure).

`parse_request` (and `parse_count_request`, for `/v1/messages/count_tokens`) checks a body into a
`MessagesRequest`; `to_chat` builds the chat body (`ChatTranslation`), `from_chat` the Message for a chat
reply, and `MessagesStream` the Messages event stream for a chat stream. `count_prompt` estimates a
request's input tokens where no upstream counts them. For upstreams that speak Messages natively,
`StreamUsageReader` reads the usage of their stream as it passes. Errors leave as Anthropic's envelope
(`anthropic_error`, or `error_event` mid-stream). Nothing here does I/O.
"""

from __future__ import annotations

from mergebroker.broker.engine.apis.messages.count import count_prompt
from mergebroker.broker.engine.apis.messages.envelope import (
           anthropic_error,
           error_event,
)
from mergebroker.broker.engine.apis.messages.native import StreamUsageReader
from mergebroker.broker.engine.apis.messages.reply import from_chat
from mergebroker.broker.engine.apis.messages.request import (
           MessagesRequest,
           parse_count_request,
           parse_request,
)
from mergebroker.broker.engine.apis.messages.stream import MessagesStream
from mergebroker.broker.engine.apis.messages.translate import ChatTranslation, to_chat

__all__ = ["ChatTranslation", "MessagesRequest", "MessagesStream", "StreamUsageReader", "anthropic_error",
           "count_prompt", "error_event", "from_chat", "parse_count_request", "parse_request", "to_chat"]
