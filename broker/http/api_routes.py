"""Thin HTTP handlers for the inbound APIs beside Chat Completions: OpenAI Responses and Anthropic Messages.

Each parses nothing itself: it authenticates from the headers, reads the body, and hands both to the
engine (`engine.inbound.responses`, `engine.inbound.messages`), then writes the answer or moves the
stream's frames. Errors leave through the middleware, in the API's own envelope (`middleware`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web

from mergebroker import jsonio
from mergebroker.broker.engine.chat.service import CacheControl
from mergebroker.broker.engine.handling import authenticate
from mergebroker.broker.engine.inbound import messages, responses
from mergebroker.broker.engine.streams import HandledStream
from mergebroker.broker.http.body import BODY_LIMITS, read_json
from mergebroker.broker.http.drain import DRAIN
from mergebroker.broker.http.keys import BROKER
from mergebroker.broker.http.middleware import INFO, RESPONSE


async def create_response(request: web.Request) -> web.StreamResponse:
    return await _create(request, responses.create)


async def retrieve_response(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    caller = authenticate(broker, request[INFO], request.headers, None, None)
    return _json(await responses.retrieve(broker, caller, request.match_info["response_id"]))


async def delete_response(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    caller = authenticate(broker, request[INFO], request.headers, None, None)
    return _json(await responses.delete(broker, caller, request.match_info["response_id"]))


async def response_input_items(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    caller = authenticate(broker, request[INFO], request.headers, None, None)
    return _json(await responses.list_input_items(broker, caller, request.match_info["response_id"]))


async def create_message(request: web.Request) -> web.StreamResponse:
    return await _create(request, messages.create)


async def _create(request: web.Request, create: Any) -> web.StreamResponse:
    """One create call of an inbound API: authenticated, its body read, answered whole or as a stream."""
    broker, info = request.app[BROKER], request[INFO]
    caller = authenticate(broker, info, request.headers, None, None)
    raw = await read_json(request, request.app[BODY_LIMITS])
    answer = await create(broker, info, caller, raw, request.headers,
                          CacheControl.from_header(request.headers.get("Cache-Control")))
    if isinstance(answer, HandledStream):
        return await send_stream(request, answer)
    return _json(answer.body, answer.headers)


async def count_message_tokens(request: web.Request) -> web.Response:
    broker, info = request.app[BROKER], request[INFO]
    caller = authenticate(broker, info, request.headers, None, None)
    raw = await read_json(request, request.app[BODY_LIMITS])
    return _json(await messages.count_tokens(broker, info, caller, raw, request.headers))


async def send_stream(request: web.Request, stream: HandledStream) -> web.StreamResponse:
    """Write a handled stream's frames as SSE; whatever happens, the stream is closed and settled."""
    info = request[INFO]
    response = request[RESPONSE] = web.StreamResponse()  # noted, so the middleware never answers twice
    try:
        response.headers.update({"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                 "X-Request-ID": info.request_id,
                                 "X-Broker-Overhead-Ms": _overhead_ms(info),
                                 **stream.headers})
        await response.prepare(request)
        async for frame in stream:
            await response.write(frame)
    except asyncio.CancelledError:
        drain = request.app.get(DRAIN)
        if drain is None or not drain.expired or not response.prepared:
            raise  # the client left (or the middleware answers the 503: nothing was sent yet)
        # Cut by the shutdown drain's deadline: the stream ends as a failed one, in its API's own format.
        asyncio.current_task().uncancel()  # type: ignore[union-attr]
        for frame in stream.interrupt(drain.refusal()):
            await response.write(frame)
    finally:
        await stream.aclose()
    await response.write_eof()
    return response


def _overhead_ms(info: Any) -> str:
    """Time in the broker before the stream's first frame, less the upstream's time to its first chunk."""
    return f"{max(0.0, time.perf_counter() - info.started - info.upstream_s) * 1000:.2f}"


def _json(body: Any, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=jsonio.dumps(body), content_type="application/json", headers=headers)
