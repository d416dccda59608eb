"""`translated_errors` maps each HTTP client failure (aiohttp's and the lean client's) onto the broker's upstream errors, and lets the rest through."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from mergebroker.errors import (
    UpstreamBadResponse,
    UpstreamConnectionError,
    UpstreamError,
    UpstreamHTTPError,
    UpstreamTimeout,
)
from mergebroker.providers.http1_client import MalformedAnswer
from mergebroker.providers.openai.wire import translated_errors


@pytest.mark.parametrize(("raised", "expected"), [
    (TimeoutError(), UpstreamTimeout),
    (aiohttp.ServerTimeoutError(), UpstreamTimeout),  # a timeout and a connection error: the timeout wins
    (aiohttp.ServerDisconnectedError(), UpstreamConnectionError),
    (aiohttp.ClientPayloadError("cut"), UpstreamConnectionError),
    (aiohttp.InvalidURL("x"), UpstreamConnectionError),
    (aiohttp.ClientResponseError(None, (), status=200), UpstreamBadResponse),  # type: ignore[arg-type]
    # the lean client's (providers.http1_client): Python's own errors, and its one of its own
    (ConnectionRefusedError(), UpstreamConnectionError),
    (ConnectionResetError("cut"), UpstreamConnectionError),
    (MalformedAnswer("junk"), UpstreamBadResponse),
])
def test_aiohttp_failures_become_upstream_errors_with_their_cause(raised: Exception,
                                                                  expected: type[UpstreamError]) -> None:
    with pytest.raises(expected) as caught, translated_errors("p", "/chat/completions"):
        raise raised
    assert caught.value.__cause__ is raised and "/chat/completions" in str(caught.value)


@pytest.mark.parametrize("raised", [UpstreamHTTPError(503, "busy"), asyncio.CancelledError(), ValueError("ours")])
def test_upstream_errors_cancellation_and_other_errors_pass_through_untouched(raised: BaseException) -> None:
    with pytest.raises(type(raised)) as caught, translated_errors("p", "/chat/completions"):
        raise raised
    assert caught.value is raised


def test_a_call_that_ends_well_is_left_alone() -> None:
    with translated_errors("p", "/chat/completions"):
        value = 1
    assert value == 1
