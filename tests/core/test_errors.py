"""Upstream error statuses map to the right client status, fault, retryability and message."""

from __future__ import annotations

import pytest

from mergebroker.errors import UpstreamHTTPError

KEY_TAIL = "sk-...wxyz"


def upstream_envelope(message: str, type_: str = "invalid_request_error", code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


@pytest.mark.parametrize("status", [401, 403, 407])
def test_a_rejection_of_the_brokers_credentials_is_a_retryable_502_that_hides_the_upstream_text(
        status: int) -> None:
    text = f"Incorrect API key provided: {KEY_TAIL}. You can find your API key at https://example.invalid."
    error = UpstreamHTTPError(status, text, body=upstream_envelope(text, code="invalid_api_key"))
    assert (error.status, error.retryable, error.caller_fault) == (502, True, False)
    assert error.body() == {"error": {"message": "The upstream rejected the broker's credentials",
                                      "type": "upstream_error", "param": None, "code": "upstream_error"}}
    assert KEY_TAIL not in str(error) and error.upstream_body is None
    assert error.upstream_status == status


@pytest.mark.parametrize("status", [400, 404, 413, 422])
def test_request_faults_keep_their_status_and_the_upstreams_envelope(status: int) -> None:
    error = UpstreamHTTPError(status, "max_tokens is too large",
                              body=upstream_envelope("max_tokens is too large", code="invalid_value"))
    assert (error.status, error.retryable, error.caller_fault) == (status, False, True)
    assert error.body()["error"] == {"message": "max_tokens is too large", "type": "invalid_request_error",
                                     "param": None, "code": "invalid_value"}


def test_a_content_filter_refusal_stays_the_callers_fault() -> None:
    body = upstream_envelope("The response was filtered", code="content_filter")
    error = UpstreamHTTPError(400, "The response was filtered", body=body)
    assert error.caller_fault and error.status == 400 and error.code == "content_filter"


@pytest.mark.parametrize("status", [408, 409, 500, 502, 503])
def test_server_side_statuses_are_retryable_502s(status: int) -> None:
    error = UpstreamHTTPError(status, "upstream trouble")
    assert (error.status, error.retryable, error.type) == (502, True, "upstream_error")


def test_an_upstream_429_passes_through_with_its_retry_after() -> None:
    error = UpstreamHTTPError(429, "slow down", retry_after=2.5)
    assert (error.status, error.retryable, error.code) == (429, True, "rate_limit_exceeded")
    assert error.headers() == {"Retry-After": "3"}
