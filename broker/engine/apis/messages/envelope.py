"""Anthropic's error envelope and SSE framing: how an error or event leaves a Messages endpoint (pure).

`{"type": "error", "error": {"type": ..., "message": ...}}`, its `type` chosen by HTTP status as Anthropic
chooses it. An overloaded broker (503) answers 529, Anthropic's own status for it: the SDKs and Claude Code
retry a 529 as a transient overload, and a 503 would be reported as a failure instead.
"""

from __future__ import annotations

from typing import Any

from mergebroker.jsonio import dumps

OVERLOADED_STATUS = 529
_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
              403: "permission_error", 404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
              503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}
ERROR_TYPES = frozenset((*_BY_STATUS.values(), "api_error"))


def anthropic_error(status: int, code: str | None, message: str, type: str | None) -> tuple[int, dict[str, Any]]:
    """The status to send and the Anthropic error body for a broker error (its HTTP `status`, OpenAI-style
    `code` and `type`). `type` is kept where it is already one of Anthropic's and the status names none."""
    error_type = error_type_for(status, type)
    sent = OVERLOADED_STATUS if error_type == "overloaded_error" else status
    return sent, {"type": "error", "error": {"type": error_type, "message": message}}


def error_event(status: int, code: str | None, message: str, type: str | None) -> bytes:
    """The `error` event that ends a Messages stream which failed mid-way, typed as `anthropic_error` types it."""
    return sse("error", anthropic_error(status, code, message, type)[1])


def error_type_for(status: int, type: str | None) -> str:
    """Anthropic's error type for an HTTP status: by the table, else the given `type` when it is Anthropic's,
    else `invalid_request_error` for a 4xx and `api_error` for anything else."""
    if status in _BY_STATUS:
        return _BY_STATUS[status]
    if type in ERROR_TYPES:
        return type
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


def sse(event: str, data: dict[str, Any]) -> bytes:
    """One server-sent event as Anthropic frames it: `event: <type>`, then its compact JSON `data`."""
    return b"event: " + event.encode() + b"\ndata: " + dumps(data) + b"\n\n"
