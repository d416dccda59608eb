"""`POST /v1/messages` and `/v1/messages/count_tokens`, apart from the transport (HTTP and library alike).

Served like `/v1/responses` (see `inbound.responses`): a text-only request runs as the chat request it
translates to (coalesced, cached, merged; its `system` is the shared prefix); otherwise a `kind:
anthropic` upstream gets the body as sent, with the caller's `anthropic-version` and `anthropic-beta`
headers, and the other kinds get its chat form, answered back as a Message.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from mergebroker.broker.engine.accounting.request_record import RequestInfo
from mergebroker.broker.engine.apis.messages import (
    MessagesRequest,
    MessagesStream,
    count_prompt,
    from_chat,
    parse_count_request,
    parse_request,
    to_chat,
)
from mergebroker.broker.engine.chat.service import CacheControl
from mergebroker.broker.engine.container import Engine
from mergebroker.broker.engine.ground.schemas import parse_chat
from mergebroker.broker.engine.ground.tokens import count_text_tokens, estimate_prompt_tokens
from mergebroker.broker.engine.handling import (
    chat_headers,
    check_chat_model,
    complete_chat,
    model_not_found,
    open_chat_stream,
    price_on_arrival,
)
from mergebroker.broker.engine.inbound.messages_relay import NativeMessagesRelay
from mergebroker.broker.engine.inbound.portable import dropped_header, portable
from mergebroker.broker.engine.limits.admission import Caller
from mergebroker.broker.engine.native.calls import NativeCalls, NativeRequest
from mergebroker.broker.engine.streams import HandledStream, TranslatedRelay
from mergebroker.errors import UpstreamUnsupported
from mergebroker.providers.native_api import forwarded

COUNT_TIMEOUT_S = 30.0


@dataclass
class MessagesAnswer:
    """A finished (non-streamed) Messages request: the Message and the broker's headers."""

    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


def new_message_id() -> str:
    return "msg_" + secrets.token_hex(12)


async def create(broker: Engine, info: RequestInfo, caller: Caller, raw: Any, headers: Mapping[str, str],
                 cache_control: CacheControl) -> MessagesAnswer | HandledStream:
    """Answer one `POST /v1/messages` (the caller authenticated from the headers)."""
    request = parse_request(raw)
    info.model = request.model
    if not broker.pools.serves(request.model):
        raise model_not_found(request.model)
    translation = to_chat(request)
    chat_body, cut = portable(translation.body)
    if not request.text_only and broker.pools.speaks(request.model, "messages"):
        try:
            return await _native(broker, info, caller, request, chat_body, headers)
        except UpstreamUnsupported as exc:
            if exc.code != "native_unsupported":
                raise
    return await _translated(broker, info, caller, request, chat_body, (*translation.dropped, *cut), cache_control)


async def _native(broker: Engine, info: RequestInfo, caller: Caller, request: MessagesRequest,
                  chat_body: dict[str, Any],
                  headers: Mapping[str, str]) -> MessagesAnswer | HandledStream:
    body = {k: v for k, v in request.body.items() if k != "broker"}
    given = request.body.get("broker")
    options: dict[str, Any] = given if isinstance(given, dict) else {}
    price_on_arrival(broker, info, chat_body)
    native = NativeRequest("messages", body, forwarded(headers), chat_body, timeout_s=options.get("timeout_s"))
    calls = cast(NativeCalls, broker.native)  # wired (assemble.py) wherever a pool speaks a native API
    if request.stream:
        return await calls.stream(info, caller, native, NativeMessagesRelay)
    reply, answer_headers = await calls.complete(info, caller, native)
    return MessagesAnswer(reply, answer_headers)


async def _translated(broker: Engine, info: RequestInfo, caller: Caller, request: MessagesRequest,
                      chat_body: dict[str, Any],
                      dropped: tuple[str, ...], cache_control: CacheControl) -> MessagesAnswer | HandledStream:
    parsed, body = parse_chat(chat_body, max_messages=broker.settings.server.max_messages)
    check_chat_model(broker, info, parsed, body)
    info.dropped, extra = tuple(dict.fromkeys(dropped)), dropped_header(dropped)
    message_id = new_message_id()
    if parsed.stream:
        stream = MessagesStream(request, message_id=message_id,
                                prompt_tokens_estimate=estimate_prompt_tokens(body["messages"]))
        return await open_chat_stream(broker, info, caller, parsed, body, relay=TranslatedRelay(stream), headers=extra)
    result = await complete_chat(broker, info, caller, parsed, body, cache_control)
    reply = from_chat(result.outcome.body, request, message_id=message_id)
    return MessagesAnswer(reply, {**chat_headers(result), **extra})


async def count_tokens(broker: Engine, info: RequestInfo, caller: Caller, raw: Any,
                       headers: Mapping[str, str]) -> dict[str, Any]:
    """`POST /v1/messages/count_tokens`: forwarded to an Anthropic upstream, else counted by the broker."""
    request = parse_count_request(raw)
    info.model = request.model
    if not broker.pools.serves(request.model):
        raise model_not_found(request.model)
    if broker.pools.speaks(request.model, "count_tokens"):
        body = {k: v for k, v in request.body.items() if k != "broker"}
        try:
            reply, info.provider = await broker.pools.native(
                request.model, "count_tokens", body, headers=forwarded(headers),
                deadline=broker.clock() + COUNT_TIMEOUT_S, tenant=caller.tenant)
            return reply
        except UpstreamUnsupported as exc:
            if exc.code != "native_unsupported":
                raise
    return {"input_tokens": _estimated(broker, request)}


def _estimated(broker: Engine, request: MessagesRequest) -> int:
    """The broker's count of a request's input tokens, in the provider's tokens once the broker has learnt
    how they compare (the cost book's calibration, from the usage its upstreams reported for this model)."""
    ratio = broker.costs.calibration.learnt(request.model) if broker.costs is not None else None
    if ratio is None:
        return count_prompt(request, count_text_tokens)
    # Scaled on the count the calibration was learnt against: the chat form's prompt estimate.
    return round(ratio * estimate_prompt_tokens(to_chat(request).body["messages"]))
