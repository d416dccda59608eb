"""Request bodies at the byte level: a bounded read, bounded decompression and a JSON parse of bounded cost.

aiohttp's own decompression is off (`handler_args`), so every limit applies in one place and in the
right order: the declared and the received size before anything is inflated, the inflated size while
inflating (a small gzip bomb stops at `max_bytes`), then strict UTF-8, JSON without `NaN`, `Infinity` or
numbers that overflow to them, no lone surrogates, and a bounded nesting depth. Each failure is a 4xx
`BrokerError`, never an exception the middleware would have to call a 500.
"""

from __future__ import annotations

import asyncio
import zlib
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from mergebroker.errors import InvalidRequest, PayloadTooLarge, RequestTimeout, UnsupportedMediaType
from mergebroker.jsonio import NotStrictJson, parse_strict

HANDLER_ARGS = {"auto_decompress": False}
"""aiohttp handler arguments for apps that read their bodies through `read_json` (it decompresses itself)."""

_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


@dataclass(frozen=True)
class BodyLimits:
    """What one request body may cost: bytes (before and after inflating), seconds to arrive, nesting depth."""

    max_bytes: int
    timeout_s: float
    max_depth: int = 64


BODY_LIMITS = web.AppKey("body_limits", BodyLimits)


async def read_json(request: web.Request, limits: BodyLimits) -> Any:
    """The request's JSON body, read, inflated and parsed within `limits`."""
    content_type = request.headers.get("Content-Type", "")
    if content_type and not content_type.lower().startswith("application/json"):
        raise UnsupportedMediaType(f"Content-Type must be application/json, got '{content_type}'.")
    if request.content_length is not None and request.content_length > limits.max_bytes:
        raise _too_large(limits)
    try:
        if request.content.is_eof():  # already in full (most are: it came with the headers): no timer to arm
            raw = await request.read()
        else:
            async with asyncio.timeout(limits.timeout_s):
                raw = await request.read()
    except TimeoutError:
        raise RequestTimeout(f"The request body did not arrive within {limits.timeout_s:g} s.") from None
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(limits) from None
    return parse_json(inflate(raw, request.headers.get("Content-Encoding", ""), limits.max_bytes), limits.max_depth)


def inflate(raw: bytes, encoding: str, max_bytes: int) -> bytes:
    """`raw` decoded from its `Content-Encoding`, at most `max_bytes` long (413 past it, 400 if corrupt)."""
    name = encoding.strip().lower()
    if name in ("", "identity"):
        return raw
    if name not in _WBITS:
        raise UnsupportedMediaType(f"Content-Encoding '{encoding[:40]}' is not supported; use gzip, deflate or "
                                   "none.", code="unsupported_content_encoding")
    wbits = _WBITS[name]
    if name == "deflate" and raw[:1] and (raw[0] & 0x0F) != 8:
        wbits = -zlib.MAX_WBITS  # raw deflate without the zlib header, as some clients send it
    inflater = zlib.decompressobj(wbits)
    try:
        out = inflater.decompress(raw, max_bytes + 1)
        complete = inflater.eof
    except zlib.error:
        raise InvalidRequest(f"The request body is not valid {name} data.", code="invalid_encoding") from None
    if len(out) > max_bytes:
        raise PayloadTooLarge(f"Request body too large once decompressed: the limit is {max_bytes} bytes.")
    if not complete:
        raise InvalidRequest(f"The request body is truncated {name} data.", code="invalid_encoding")
    return out


def parse_json(raw: bytes, max_depth: int) -> Any:
    """Strict JSON (`mergebroker.jsonio.parse_strict`), or the 400 that says which rule the body broke."""
    try:
        return parse_strict(raw, max_depth)
    except NotStrictJson as exc:
        if exc.reason == "depth":
            raise InvalidRequest(f"The JSON body is nested deeper than {max_depth} levels.", code="invalid_json") from None
        if exc.reason == "surrogate":
            raise InvalidRequest("The JSON body holds a lone UTF-16 surrogate (\\ud800-\\udfff) that is not "
                                 "part of a pair.", code="invalid_json") from None
        raise InvalidRequest("We could not parse the JSON body of your request.", code="invalid_json") from None


def _too_large(limits: BodyLimits) -> PayloadTooLarge:
    return PayloadTooLarge(f"Request body too large: the limit is {limits.max_bytes} bytes.")
