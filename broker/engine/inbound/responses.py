"""`POST /v1/responses` and its stored responses, apart from the transport (HTTP and library alike).

A request is served one of three ways, decided in `route`:
- **merged like chat**: a text-only request (no tools, no state) runs as the chat request it translates
  to, so it is coalesced, cached and merged with chat traffic (`instructions` is its system prompt);
- **native**: an upstream of the model speaks the Responses API, and gets the body as sent (hosted tools,
  encrypted reasoning and namespaces intact), through the same limits, pools and breakers;
- **translated**: otherwise, the chat form goes through the chat path and the answer is turned back.
A native call that meets an upstream without the route (404/405, remembered) is translated instead.

`store` and `previous_response_id` are the broker's own on every path (`ResponseStore`): a chain's
earlier turns are sent as input items, so it continues on whichever upstream serves the next turn.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from mergebroker.broker.engine.accounting.request_record import RequestInfo
from mergebroker.broker.engine.apis.responses import (
    ResponsesRequest,
    ResponsesStream,
    from_chat,
    input_items,
    parse_request,
    to_chat,
)
from mergebroker.broker.engine.chat.service import CacheControl
from mergebroker.broker.engine.container import Engine
from mergebroker.broker.engine.ground.response_store import StoredResponse, chain_history
from mergebroker.broker.engine.ground.schemas import parse_chat
from mergebroker.broker.engine.handling import (
    chat_headers,
    check_chat_model,
    complete_chat,
    model_not_found,
    open_chat_stream,
    price_on_arrival,
)
from mergebroker.broker.engine.inbound.portable import dropped_header, portable
from mergebroker.broker.engine.inbound.responses_relay import NativeResponsesRelay
from mergebroker.broker.engine.limits.admission import Caller
from mergebroker.broker.engine.native.calls import NativeCalls, NativeRequest
from mergebroker.broker.engine.streams import HandledStream, TranslatedRelay
from mergebroker.errors import InvalidRequest, NotFound, UpstreamUnsupported
from mergebroker.providers.native_api import forwarded


@dataclass
class ResponsesAnswer:
    """A finished (non-streamed) Responses request: the Response object and the broker's headers."""

    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class _Turn:
    """One request as the broker serves it: parsed, its chain's history, and its chat form."""

    request: ResponsesRequest
    history: list[dict[str, Any]]
    chat_body: dict[str, Any]
    dropped: tuple[str, ...]
    translation: Any
    response_id: str
    created_at: int


def new_response_id() -> str:
    return "resp_" + secrets.token_hex(24)


async def create(broker: Engine, info: RequestInfo, caller: Caller, raw: Any, headers: Mapping[str, str],
                 cache_control: CacheControl) -> ResponsesAnswer | HandledStream:
    """Answer one `POST /v1/responses` (authenticated from the headers; the body not yet read)."""
    turn = await _turn(broker, caller, raw)
    info.model = turn.request.model
    if not broker.pools.serves(turn.request.model):
        raise model_not_found(turn.request.model)
    if route(broker, turn) == "native":
        try:
            return await _native(broker, info, caller, turn, headers)
        except UpstreamUnsupported as exc:
            if exc.code != "native_unsupported":
                raise
    return await _translated(broker, info, caller, turn, cache_control)


async def _turn(broker: Engine, caller: Caller, raw: Any) -> _Turn:
    previous = raw.get("previous_response_id") if isinstance(raw, dict) else None
    history: list[dict[str, Any]] = []
    if isinstance(previous, str) and previous:
        found = await chain_history(broker.responses, caller.tenant, previous)
        if found is None:
            raise NotFound(f"Previous response with id '{previous}' not found.", param="previous_response_id",
                           code="previous_response_not_found")
        history = found
    request = parse_request(raw, history=history)
    if request.background:
        raise InvalidRequest("background responses are not supported by this broker: send the request without "
                             "'background'.", param="background")
    translation = to_chat(request, history=history)
    chat_body, cut = portable(translation.body)
    return _Turn(request, history, chat_body, tuple(translation.dropped) + cut, translation, new_response_id(),
                 int(time.time()))


def route(broker: Engine, turn: _Turn) -> str:
    """`merged` (as chat), `native` or `translated` (see the module docstring)."""
    if turn.request.text_only and not turn.history:
        return "merged"
    return "native" if broker.pools.speaks(turn.request.model, "responses") else "translated"


def _native_body(turn: _Turn) -> dict[str, Any]:
    """The body as sent, minus the broker's own options; a chain's earlier turns become input items."""
    body = {k: v for k, v in turn.request.body.items() if k != "broker"}
    if turn.history:
        given = body.get("input")
        current = [{"role": "user", "content": given}] if isinstance(given, str) else list(given or [])
        body["input"] = [*_replayable(turn.history), *current]
        body.pop("previous_response_id", None)
    return body


def _replayable(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stored chain's items as an upstream takes them back as input: without the ids and statuses the
    broker or another upstream gave them (an upstream looks an id up in its own store and 404s on one it
    never made), and without reasoning it cannot read (only `encrypted_content` carries reasoning across)."""
    kept = []
    for item in history:
        if item.get("type") == "reasoning" and not item.get("encrypted_content"):
            continue
        kept.append({k: v for k, v in item.items() if k not in ("id", "status")})
    return kept


async def _native(broker: Engine, info: RequestInfo, caller: Caller, turn: _Turn,
                  headers: Mapping[str, str]) -> ResponsesAnswer | HandledStream:
    given = turn.request.body.get("broker")
    options: dict[str, Any] = given if isinstance(given, dict) else {}
    price_on_arrival(broker, info, turn.chat_body)
    native = NativeRequest("responses", _native_body(turn), forwarded(headers), turn.chat_body,
                           timeout_s=options.get("timeout_s"))
    calls = cast(NativeCalls, broker.native)  # wired (assemble.py) wherever a pool speaks a native API
    if turn.request.stream:
        return await calls.stream(info, caller, native,
                                  lambda: NativeResponsesRelay(lambda r: _keep(broker, caller, turn, r)))
    reply, answer_headers = await calls.complete(info, caller, native)
    _keep(broker, caller, turn, reply)
    return ResponsesAnswer(reply, answer_headers)


async def _translated(broker: Engine, info: RequestInfo, caller: Caller, turn: _Turn,
                      cache_control: CacheControl) -> ResponsesAnswer | HandledStream:
    parsed, body = parse_chat(turn.chat_body, max_messages=broker.settings.server.max_messages)
    check_chat_model(broker, info, parsed, body)
    info.dropped, dropped = tuple(dict.fromkeys(turn.dropped)), dropped_header(turn.dropped)
    if parsed.stream:
        stream = ResponsesStream(turn.request, turn.translation, response_id=turn.response_id,
                                 created_at=turn.created_at, previous_response_id=turn.request.previous_response_id)
        relay = TranslatedRelay(stream, lambda: _keep(broker, caller, turn, stream.final_response))
        return await open_chat_stream(broker, info, caller, parsed, body, relay=relay, headers=dropped)
    result = await complete_chat(broker, info, caller, parsed, body, cache_control)
    reply = from_chat(result.outcome.body, turn.request, turn.translation, response_id=turn.response_id,
                      created_at=turn.created_at, previous_response_id=turn.request.previous_response_id)
    _keep(broker, caller, turn, reply)
    return ResponsesAnswer(reply, {**chat_headers(result), **dropped})


def _keep(broker: Engine, caller: Caller, turn: _Turn, response: dict[str, Any] | None) -> None:
    """Store a finished response when the request asked for it (`store` is true by default)."""
    if response is None or not turn.request.store or not isinstance(response.get("id"), str):
        return
    items = input_items(turn.request, response_id=response["id"])
    broker.responses.keep(caller.tenant, response, items, turn.request.previous_response_id)


async def retrieve(broker: Engine, caller: Caller, response_id: str) -> dict[str, Any]:
    """`GET /v1/responses/{id}`: the tenant's stored response, or 404."""
    return (await _stored(broker, caller, response_id)).response


async def delete(broker: Engine, caller: Caller, response_id: str) -> dict[str, Any]:
    """`DELETE /v1/responses/{id}`: the deletion object, or 404."""
    if not await broker.responses.delete(caller.tenant, response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


async def list_input_items(broker: Engine, caller: Caller, response_id: str) -> dict[str, Any]:
    """`GET /v1/responses/{id}/input_items`: the turn's input items as a list object, or 404."""
    items = (await _stored(broker, caller, response_id)).input_items
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": False}


async def _stored(broker: Engine, caller: Caller, response_id: str) -> StoredResponse:
    stored = await broker.responses.get(caller.tenant, response_id)
    if stored is None:
        raise _not_found(response_id)
    return stored


def _not_found(response_id: str) -> NotFound:
    return NotFound(f"No response found with id '{response_id}'.", param="response_id", code="response_not_found")
