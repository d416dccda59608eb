"""The HTTP wire shared by the OpenAI-shaped upstreams (chat, Batch API, Anthropic's transport): the HTTP
clients' failures (aiohttp's, and `providers.http1_client`'s, which are Python's own) mapped onto the
`UpstreamError` family, bodies decoded leniently, and a non-2xx answer read into its error with the
upstream's message and Retry-After."""

from __future__ import annotations

from typing import Any

import aiohttp
import structlog

from mergebroker import jsonio
from mergebroker.errors import (
    UpstreamBadResponse,
    UpstreamConnectionError,
    UpstreamError,
    UpstreamHTTPError,
    UpstreamTimeout,
)
from mergebroker.providers.http1_client import MalformedAnswer
from mergebroker.providers.retry import parse_retry_after

log = structlog.get_logger(__name__)


class translated_errors:  # noqa: N801 - used as a function: `with translated_errors(provider, endpoint):`
    """Map the HTTP clients' exceptions onto ours (an `OSError` is a connection that failed or dropped); `UpstreamError`s and cancellation pass through untouched.

    A plain class rather than a generator-based context manager: it wraps every upstream call, and the
    generator form costs several times more to enter and leave."""

    __slots__ = ("_provider", "_endpoint")

    def __init__(self, provider: str, endpoint: str) -> None:
        self._provider, self._endpoint = provider, endpoint

    def __enter__(self) -> None:
        return None

    def __exit__(self, _type: type[BaseException] | None, exc: BaseException | None, _tb: Any) -> None:
        if exc is None or isinstance(exc, UpstreamError) or not isinstance(exc, Exception):
            return  # nothing to map: passes through as it is (the `with` re-raises it)
        endpoint = self._endpoint
        if isinstance(exc, TimeoutError):  # before ClientConnectionError: ServerTimeoutError is both
            log.debug("provider_call_failed", provider=self._provider, endpoint=endpoint, error="timeout")
            raise UpstreamTimeout(f"upstream {endpoint} timed out") from exc
        if isinstance(exc, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, aiohttp.InvalidURL, OSError)):
            # A truncated body means the connection dropped mid-answer; a bad URL can never connect.
            log.debug("provider_call_failed", provider=self._provider, endpoint=endpoint, error=type(exc).__name__)
            raise UpstreamConnectionError(f"upstream {endpoint} connection failed: {type(exc).__name__}") from exc
        if isinstance(exc, (aiohttp.ClientError, MalformedAnswer)):
            log.debug("provider_call_failed", provider=self._provider, endpoint=endpoint, error=type(exc).__name__)
            raise UpstreamBadResponse(f"upstream {endpoint} sent a malformed HTTP answer") from exc


def decode_json(raw: bytes) -> Any:
    """`raw` as JSON, or None where it is not JSON (an error page, a cut body)."""
    try:
        return jsonio.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None


def http_error(status: int, headers: Any, raw: bytes) -> UpstreamHTTPError:
    """The error for a non-2xx answer, with the upstream's envelope message and Retry-After when present."""
    body = decode_json(raw)
    body = body if isinstance(body, dict) else None
    error = body.get("error") if body else None
    message = f"upstream answered HTTP {status}"
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        message = error["message"]
    elif isinstance(error, str):
        message = error
    retry_after = parse_retry_after(headers.get("Retry-After"))
    retry_after_ms = parse_retry_after(headers.get("retry-after-ms"))  # OpenAI's finer-grained variant
    if retry_after_ms is not None:
        retry_after = retry_after_ms / 1000.0
    return UpstreamHTTPError(status, message, retry_after=retry_after, body=body)
