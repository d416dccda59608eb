"""Who is calling and in which tier: API keys, gateway headers, or open (development) mode.

Keys are stored as SHA-256 hashes and compared in constant time; the gateway mode trusts
`X-Broker-Tenant` / `X-Broker-Tier` / `X-Broker-User` only next to the shared secret in
`X-Broker-Gateway-Secret`, and never the request body's `broker.tier` or `user`: the gateway decides
who calls, not its client.
Open mode (development) makes every caller the default tenant, in the default tier unless
`X-Broker-Tier` names another. A missing or wrong credential is 401; a tier the caller may not use, or
that does not exist, is 403.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass

from multidict import CIMultiDict, CIMultiDictProxy

from mergebroker.broker.engine.ground.settings import ApiKeySettings, AuthSettings
from mergebroker.broker.engine.limits.ratelimit import LimitSpec
from mergebroker.errors import Forbidden, Unauthorized
from mergebroker.frozen_init import direct_init

TENANT_HEADER = "X-Broker-Tenant"
TIER_HEADER = "X-Broker-Tier"
USER_HEADER = "X-Broker-User"
GATEWAY_SECRET_HEADER = "X-Broker-Gateway-Secret"


@direct_init  # built on every request
@dataclass(frozen=True)
class Caller:
    """An authenticated caller: its tenant, the tier it runs in, and its key's own limits."""

    tenant: str
    tier: str
    key_id: str | None = None
    key_rpm: int | None = None
    key_tpm: int | None = None
    user: str | None = None

    def limits(self, tier_limit: LimitSpec) -> list[LimitSpec]:
        """The admission limits for this caller: its tier's, and its API key's own when the key has any."""
        if self.key_id and (self.key_rpm or self.key_tpm):
            return [tier_limit, LimitSpec(f"key:{self.key_id}", self.key_rpm, self.key_tpm)]
        return [tier_limit]


@dataclass(frozen=True)
class _Key:
    digest: bytes
    tenant: str
    tiers: tuple[str, ...]
    default_tier: str
    rpm: int | None
    tpm: int | None


class Authenticator:
    """Maps request headers to a `Caller`, or raises 401/403."""

    def __init__(self, settings: AuthSettings, *, tiers: tuple[str, ...], default_tier: str) -> None:
        self._mode = settings.mode
        self._tiers = tiers
        self._default_tier = default_tier
        self._default_tenant = settings.default_tenant
        self._secret = settings.gateway_secret.get_secret_value().encode() if settings.gateway_secret else b""
        self._keys = [_key(k, default_tier) for k in settings.keys]

    @property
    def mode(self) -> str:
        """"open", "keys" or "gateway"."""
        return self._mode

    def authenticate(self, headers: Mapping[str, str], *, body_tier: str | None = None,
                     body_user: str | None = None) -> Caller:
        """Identify the caller and its tier; `body_tier` is the request's `broker.tier`, if any.

        Header names are matched case-insensitively, whatever mapping is passed. The gateway mode
        ignores `body_tier` and `body_user`.
        """
        if not isinstance(headers, (CIMultiDict, CIMultiDictProxy)):
            headers = CIMultiDict(headers)
        if self._mode == "gateway":
            return self._by_gateway(headers)
        requested = headers.get(TIER_HEADER) or body_tier
        if self._mode == "keys":
            return self._by_key(headers, requested, body_user)
        tier = self._known_tier(requested or self._default_tier)
        return Caller(tenant=self._default_tenant, tier=tier, user=_text(headers, USER_HEADER) or body_user)

    def _by_key(self, headers: Mapping[str, str], requested: str | None, user: str | None) -> Caller:
        token = _bearer(headers)
        if not token:
            raise Unauthorized("Missing API key. Send it as 'Authorization: Bearer <key>' (or 'x-api-key: <key>').")
        digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()  # undecodable bytes: no match
        match = None
        for key in self._keys:  # compare against every key so timing does not reveal which one matched
            if hmac.compare_digest(key.digest, digest):
                match = key
        if match is None:
            raise Unauthorized("Incorrect API key provided.")
        tier = requested or match.default_tier
        self._known_tier(tier)
        if tier not in match.tiers:
            raise Forbidden(f"This API key may not use tier '{tier}'.", param="X-Broker-Tier")
        return Caller(tenant=match.tenant, tier=tier, key_id=digest.hex()[:12], key_rpm=match.rpm,
                      key_tpm=match.tpm, user=_text(headers, USER_HEADER) or user)

    def _by_gateway(self, headers: Mapping[str, str]) -> Caller:
        given = headers.get(GATEWAY_SECRET_HEADER, "").encode("utf-8", "surrogateescape")
        if not self._secret or not hmac.compare_digest(given, self._secret):
            raise Unauthorized("Missing or wrong gateway secret.", code="invalid_gateway_secret")
        tenant = _text(headers, TENANT_HEADER)
        if not tenant:
            raise Unauthorized(f"The gateway must set {TENANT_HEADER}.", code="missing_tenant")
        tier = self._known_tier(headers.get(TIER_HEADER) or self._default_tier)
        return Caller(tenant=tenant, tier=tier, user=_text(headers, USER_HEADER))

    def _known_tier(self, tier: str) -> str:
        if tier not in self._tiers:
            raise Forbidden(f"Unknown tier '{tier}'.", param="X-Broker-Tier", code="unknown_tier")
        return tier


def _key(k: ApiKeySettings, fallback_tier: str) -> _Key:
    # An explicit default_tier is a grant even when `tiers` forgets to name it; a key naming no tier at
    # all may use none (every request 403) rather than silently getting the broker's default tier.
    tiers = tuple(dict.fromkeys([*k.tiers, *([k.default_tier] if k.default_tier else [])]))
    default = k.default_tier or (k.tiers[0] if k.tiers else fallback_tier)
    return _Key(bytes.fromhex(k.sha256), k.tenant, tiers, default, k.rpm, k.tpm)


def _text(headers: Mapping[str, str], name: str) -> str | None:
    """A header naming who calls, which must be text: bytes that are not UTF-8 are refused (401), never
    carried into keys, logs and metrics. (aiohttp hands such bytes over as lone surrogates.)"""
    value = headers.get(name)
    if value is None:
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise Unauthorized(f"The {name} header is not valid UTF-8.", code="invalid_header") from None
    return value


def _bearer(headers: Mapping[str, str]) -> str | None:
    """The caller's key: `Authorization: Bearer <key>`, or Anthropic's `x-api-key: <key>` (the SDK's and
    Claude Code's way of sending it)."""
    value = headers.get("Authorization", "")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer":
        return headers.get("x-api-key", "").strip() or None
    return token.strip() or None
