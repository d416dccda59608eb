"""Anthropic's errors as the broker's upstream errors (pure): the envelope, its types and its statuses.

`to_error` maps an error answer (`{"type": "error", "error": {type, message}}`), and `stream_error` an
`error` event met mid-stream; 529 `overloaded_error` becomes a retryable 503 with a Retry-After.
"""

from __future__ import annotations

from typing import Any

from mergebroker.errors import UpstreamHTTPError

OVERLOADED_STATUS = 529
OVERLOADED_RETRY_AFTER_S = 1.0
"""Suggested wait after a 529 that named none: overload clears in seconds, and a retry at once only adds to it."""

ERROR_TYPES = {"invalid_request_error": "invalid_request_error", "not_found_error": "invalid_request_error",
               "request_too_large": "invalid_request_error", "rate_limit_error": "rate_limit_error",
               "authentication_error": "invalid_request_error", "permission_error": "permission_error",
               "billing_error": "invalid_request_error", "timeout_error": "timeout_error",
               "api_error": "server_error", "overloaded_error": "server_error"}
"""Anthropic error `type` -> OpenAI error `type`; Anthropic's own type travels on as the error's `code`."""

_STREAM_ERROR_STATUS = {"overloaded_error": OVERLOADED_STATUS, "rate_limit_error": 429, "api_error": 500,
                        "timeout_error": 504, "invalid_request_error": 400, "request_too_large": 413}


def to_error(status: int, body: Any, *, retry_after: float | None) -> UpstreamHTTPError:
    """The `UpstreamHTTPError` for an Anthropic error answer (`{"type": "error", "error": {type, message}}`).

    400/404/413 stay the caller's fault and 401/403 the broker's credentials, as for any upstream;
    429 keeps its Retry-After; 529 `overloaded_error` is a retryable 503 whose Retry-After defaults to
    `OVERLOADED_RETRY_AFTER_S` when the upstream named none.
    """
    error = body.get("error") if isinstance(body, dict) else None
    kind = str(error.get("type") or "") if isinstance(error, dict) else ""
    message = error.get("message") if isinstance(error, dict) else None
    if not isinstance(message, str) or not message:
        message = f"upstream answered HTTP {status}"
    envelope = {"error": {"message": message, "type": ERROR_TYPES.get(kind, "invalid_request_error"),
                          "code": kind or None, "param": None}}
    overloaded = status == OVERLOADED_STATUS or kind == "overloaded_error"
    if overloaded and retry_after is None:
        retry_after = OVERLOADED_RETRY_AFTER_S
    exc = UpstreamHTTPError(status, message, retry_after=retry_after, body=envelope)
    if overloaded:
        exc.status, exc.type, exc.code = 503, "service_unavailable", "upstream_overloaded"
    return exc


def stream_error(event: dict[str, Any]) -> UpstreamHTTPError:
    """The error of a stream's `error` event (its status read from the error's type)."""
    found = event.get("error")
    error: dict[str, Any] = found if isinstance(found, dict) else {}
    return to_error(_STREAM_ERROR_STATUS.get(str(error.get("type")), 500), event, retry_after=None)
