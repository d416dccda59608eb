"""The one exception hierarchy of mergebroker, and the OpenAI-shaped error envelope.

    BrokerError                      status, type, code, message, param, headers
    ├── InvalidRequest               400 invalid_request_error
    ├── Unauthorized                 401 invalid_api_key
    ├── Forbidden                    403 tier_not_allowed
    ├── NotFound                     404 model_not_found / not_found
    ├── MethodNotAllowed             405
    ├── RequestTimeout               408 the client was too slow sending its body
    ├── PayloadTooLarge              413
    ├── UnsupportedMediaType         415
    ├── RateLimited                  429 (retry_after)
    ├── Overloaded                   503 queue full / shutting down (retry_after)
    ├── UpstreamUnavailable          503 every upstream's breaker open (retry_after)
    ├── DeadlineExceeded             504 the request's own deadline passed
    └── UpstreamError                an upstream call failed (after retries, if any)
        ├── UpstreamHTTPError        upstream answered an error status (status, retry_after, body);
        │                            its rejection of the broker's credentials is a 502, never the caller's fault
        ├── UpstreamConnectionError  could not connect / connection dropped  -> 502
        ├── UpstreamTimeout          upstream did not answer in time          -> 504
        ├── UpstreamBadResponse      upstream answered 2xx with an unusable body -> 502
        └── UpstreamUnsupported      this upstream's protocol cannot carry a field of the request -> 400
                                     (param names it); pools try the model's other upstreams first

Foreign exceptions (aiohttp, redis, pybreaker) are translated at the boundary with
`raise Mapped(...) from exc`; HTTP errors leave the service through `error_body` only.
"""

from __future__ import annotations

from typing import Any


class BrokerError(Exception):
    """Base of every error the broker raises on purpose; knows how to present itself to a client."""

    status: int = 500
    type: str = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        """Extra response headers (Retry-After in whole seconds, rounded up, at least 1)."""
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, int(-(-self.retry_after // 1))))}

    def body(self) -> dict[str, Any]:
        """The OpenAI error envelope."""
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error envelope: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class InvalidRequest(BrokerError):
    status, type = 400, "invalid_request_error"


class Unauthorized(BrokerError):
    status, type, code = 401, "invalid_request_error", "invalid_api_key"


class Forbidden(BrokerError):
    status, type, code = 403, "permission_error", "tier_not_allowed"


class NotFound(BrokerError):
    status, type, code = 404, "invalid_request_error", "not_found"


class MethodNotAllowed(BrokerError):
    status, type, code = 405, "invalid_request_error", "method_not_allowed"


class RequestTimeout(BrokerError):
    status, type, code = 408, "invalid_request_error", "request_timeout"


class PayloadTooLarge(BrokerError):
    status, type, code = 413, "invalid_request_error", "payload_too_large"


class UnsupportedMediaType(BrokerError):
    status, type, code = 415, "invalid_request_error", "unsupported_media_type"


class RateLimited(BrokerError):
    status, type, code = 429, "rate_limit_error", "rate_limit_exceeded"


class Overloaded(BrokerError):
    status, type, code = 503, "service_unavailable", "overloaded"


class UpstreamUnavailable(BrokerError):
    """Every upstream able to serve the model is known to be down (breakers open)."""

    status, type, code = 503, "service_unavailable", "upstream_unavailable"

    def __init__(self, retry_after: float, message: str = "AI service busy, please retry later") -> None:
        super().__init__(message, retry_after=retry_after)


class DeadlineExceeded(BrokerError):
    status, type, code = 504, "timeout_error", "deadline_exceeded"


class UpstreamError(BrokerError):
    """An upstream call failed. `retryable` tells retry and breaker logic whether to try again."""

    status, type = 502, "upstream_error"
    code: str | None = "upstream_error"
    retryable: bool = True


CREDENTIALS_REJECTED = (401, 403, 407)
"""Upstream statuses that judge the broker's own credentials, not the client's request."""


class UpstreamHTTPError(UpstreamError):
    """The upstream answered with an error status.

    4xx other than 408/409/429 are the caller's fault, except a rejection of the broker's credentials
    (401/403/407): that is the provider's side failing, so it is a retryable 502 (another upstream may
    accept its own key) that counts against the breaker, and its message is a generic one, because the
    upstream's text would show the client a fragment of the broker's key and blame the client's.
    """

    def __init__(self, upstream_status: int, message: str, *, retry_after: float | None = None,
                 body: dict[str, Any] | None = None) -> None:
        credentials = upstream_status in CREDENTIALS_REJECTED
        caller_fault = 400 <= upstream_status < 500 and upstream_status not in (408, 409, 429) and not credentials
        status = upstream_status if (caller_fault or upstream_status == 429) else 502
        if credentials:
            message, body = "The upstream rejected the broker's credentials", None
        super().__init__(message, status=status, retry_after=retry_after)
        self.upstream_status = upstream_status
        self.upstream_body = body
        self.retryable = not caller_fault
        if caller_fault or upstream_status == 429:
            error = (body or {}).get("error") if isinstance(body, dict) else None
            if isinstance(error, dict):
                self.type = str(error.get("type") or "invalid_request_error")
                self.code = error.get("code")
                self.param = error.get("param")
            elif upstream_status == 429:
                self.type, self.code = "rate_limit_error", "rate_limit_exceeded"
            else:
                self.type, self.code = "invalid_request_error", None

    @property
    def caller_fault(self) -> bool:
        """True for 4xx caused by the request itself: these never trip a breaker."""
        return not self.retryable


class UpstreamConnectionError(UpstreamError):
    code = "upstream_connection_error"


class UpstreamTimeout(UpstreamError):
    status, type, code = 504, "timeout_error", "upstream_timeout"


class UpstreamBadResponse(UpstreamError):
    code = "upstream_bad_response"


class UpstreamUnsupported(UpstreamError):
    """The request asks for something this upstream's protocol cannot express (a field, an endpoint).

    Raised by a translating provider before anything is sent. It is the caller's request, not the
    upstream's health, so it never counts against a breaker and is not retried; a pool still offers
    the call to the model's other upstreams (another kind may carry the field) and raises this only
    when none of them answers.
    """

    status, type, code = 400, "invalid_request_error", "unsupported_parameter"
    retryable = False

    @property
    def caller_fault(self) -> bool:
        """Always true: the request, not the upstream, is what cannot be served."""
        return True
