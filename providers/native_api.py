"""Which inbound APIs an upstream takes as sent (natively), and how a native call is addressed (pure).

A caller of the broker's `/v1/responses` or `/v1/messages` is served natively by an upstream that
speaks that API (its body forwarded as sent, nothing the client relies on dropped), and translated to
Chat Completions for one that does not. `NativeMode` is the per-provider setting for the Responses API:
`auto` tries it and learns from a 404 or 405 that the upstream lacks the route, `native` always sends it,
`translate` never does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from mergebroker.errors import UpstreamHTTPError, UpstreamUnsupported

NativeApi = Literal["responses", "messages", "count_tokens"]
NativeMode = Literal["auto", "native", "translate"]

ENDPOINTS: dict[str, str] = {"responses": "/responses", "messages": "/messages",
                             "count_tokens": "/messages/count_tokens"}
"""Each native API's endpoint below the upstream's `/v1` base URL."""

FORWARDED_HEADERS = ("anthropic-version", "anthropic-beta", "openai-beta")
"""Request headers a native call carries from the caller to the upstream: the API's own version and
feature flags. Credentials never travel: the upstream gets the provider's key."""

MISSING_ROUTE = frozenset({404, 405})
"""Statuses with which an OpenAI-compatible server says it has no such route."""


def forwarded(headers: Mapping[str, str]) -> dict[str, str]:
    """The caller's headers a native call forwards (see `FORWARDED_HEADERS`)."""
    return {name: headers[name] for name in FORWARDED_HEADERS if headers.get(name)}


def not_native(provider: str, api: str) -> UpstreamUnsupported:
    """The refusal that sends a pool on to the model's other upstreams, and the caller to the translation."""
    return UpstreamUnsupported(f"Provider '{provider}' does not serve the {api} API natively.", param=None,
                               code="native_unsupported")


def lacks_route(exc: UpstreamHTTPError) -> bool:
    """Whether an upstream's answer says the route does not exist (rather than refusing this request).

    A 404 that names a model is the model's absence, not the route's: only an answer without the
    OpenAI `model_not_found` code counts."""
    if exc.upstream_status not in MISSING_ROUTE:
        return False
    body = exc.upstream_body
    error = body.get("error") if isinstance(body, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return exc.upstream_status == 405 or code != "model_not_found"
