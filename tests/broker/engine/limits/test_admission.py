"""The Authenticator maps headers to a tenant and tier in keys, gateway and open modes, or refuses with 401/403."""

from __future__ import annotations

import hashlib

import pytest
from pydantic import SecretStr

from mergebroker.broker.engine.ground.settings import ApiKeySettings, AuthSettings
from mergebroker.broker.engine.limits.admission import Authenticator
from mergebroker.errors import Forbidden, Unauthorized

TIERS = ("realtime", "standard", "batch")


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def keys_auth() -> Authenticator:
    keys = [ApiKeySettings(sha256=sha("key-alpha"), tenant="alpha", tiers=["standard"], rpm=5, tpm=1000),
            ApiKeySettings(sha256=sha("key-beta"), tenant="beta", tiers=["standard", "batch"], default_tier="batch")]
    return Authenticator(AuthSettings(mode="keys", keys=keys), tiers=TIERS, default_tier="standard")


def bearer(token: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}", **extra}


def test_a_known_key_is_its_tenant_in_its_default_tier_with_its_limits():
    caller = keys_auth().authenticate(bearer("key-alpha"))
    assert (caller.tenant, caller.tier, caller.key_rpm, caller.key_tpm) == ("alpha", "standard", 5, 1000)
    assert caller.key_id == sha("key-alpha")[:12]  # an ID derived from the hash, never the key


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer "}, {"Authorization": "Basic a2V5LWFscGhh"},
                                     bearer("key-gamma"), bearer("KEY-ALPHA")])
def test_a_missing_or_unknown_key_is_401_invalid_api_key(headers):
    with pytest.raises(Unauthorized) as refused:
        keys_auth().authenticate(headers)
    assert refused.value.status == 401 and refused.value.code == "invalid_api_key"


def test_only_the_hash_is_needed_to_recognise_a_key():
    auth = Authenticator(AuthSettings(mode="keys", keys=[ApiKeySettings(sha256=sha("s3cret").upper(), tenant="t")]),
                         tiers=TIERS, default_tier="standard")
    assert auth.authenticate(bearer("s3cret")).tenant == "t"


def test_a_key_allowed_several_tiers_picks_one_with_the_tier_header():
    auth = keys_auth()
    assert auth.authenticate(bearer("key-beta")).tier == "batch"
    assert auth.authenticate(bearer("key-beta", **{"X-Broker-Tier": "standard"})).tier == "standard"
    assert auth.authenticate(bearer("key-beta"), body_tier="standard").tier == "standard"


def test_header_names_are_matched_case_insensitively():
    caller = keys_auth().authenticate({"authorization": "bearer key-beta", "x-broker-tier": "standard"})
    assert (caller.tenant, caller.tier) == ("beta", "standard")


def test_asking_for_a_tier_the_key_may_not_use_is_403():
    with pytest.raises(Forbidden) as refused:
        keys_auth().authenticate(bearer("key-alpha", **{"X-Broker-Tier": "realtime"}))
    assert refused.value.status == 403 and refused.value.code == "tier_not_allowed"


def test_a_key_naming_no_tier_may_use_none():
    auth = Authenticator(AuthSettings(mode="keys", keys=[ApiKeySettings(sha256=sha("k"), tenant="t", tiers=[])]),
                         tiers=TIERS, default_tier="standard")
    with pytest.raises(Forbidden):
        auth.authenticate(bearer("k"))


def test_an_unknown_tier_is_403_in_every_mode():
    gateway = Authenticator(AuthSettings(mode="gateway", gateway_secret=SecretStr("gw")), tiers=TIERS,
                            default_tier="standard")
    attempts = [(keys_auth(), bearer("key-beta", **{"X-Broker-Tier": "gold"})),
                (gateway, {"X-Broker-Gateway-Secret": "gw", "X-Broker-Tenant": "t", "X-Broker-Tier": "gold"}),
                (open_auth(), {"X-Broker-Tier": "gold"})]
    for auth, headers in attempts:
        with pytest.raises(Forbidden) as refused:
            auth.authenticate(headers)
        assert refused.value.status == 403 and refused.value.code == "unknown_tier"


def gateway_auth() -> Authenticator:
    return Authenticator(AuthSettings(mode="gateway", gateway_secret=SecretStr("shared-secret")), tiers=TIERS,
                         default_tier="standard")


def test_gateway_headers_are_trusted_next_to_the_shared_secret():
    caller = gateway_auth().authenticate({"X-Broker-Gateway-Secret": "shared-secret", "X-Broker-Tenant": "acme",
                                          "X-Broker-Tier": "batch", "X-Broker-User": "u1"})
    assert (caller.tenant, caller.tier, caller.user) == ("acme", "batch", "u1")


def test_gateway_mode_ignores_tier_and_user_named_in_the_request_body():
    headers = {"X-Broker-Gateway-Secret": "shared-secret", "X-Broker-Tenant": "acme"}
    caller = gateway_auth().authenticate(headers, body_tier="realtime", body_user="someone-else")
    assert (caller.tenant, caller.tier, caller.user) == ("acme", "standard", None)
    caller = gateway_auth().authenticate({**headers, "X-Broker-Tier": "batch", "X-Broker-User": "u1"},
                                         body_tier="realtime", body_user="someone-else")
    assert (caller.tier, caller.user) == ("batch", "u1")


def test_keys_and_open_modes_still_accept_the_body_tier_and_user():
    assert keys_auth().authenticate(bearer("key-beta"), body_tier="standard", body_user="u2").user == "u2"
    caller = open_auth().authenticate({}, body_tier="realtime", body_user="u3")
    assert (caller.tier, caller.user) == ("realtime", "u3")


@pytest.mark.parametrize("secret", [None, "", "wrong-secret", "shared-secret "])
def test_gateway_headers_without_the_right_secret_are_401(secret):
    headers = {"X-Broker-Tenant": "acme", "X-Broker-Tier": "batch"}
    if secret is not None:
        headers["X-Broker-Gateway-Secret"] = secret
    with pytest.raises(Unauthorized) as refused:
        gateway_auth().authenticate(headers)
    assert refused.value.status == 401


def test_gateway_without_a_configured_secret_refuses_everyone():
    auth = Authenticator(AuthSettings(mode="gateway"), tiers=TIERS, default_tier="standard")
    with pytest.raises(Unauthorized):
        auth.authenticate({"X-Broker-Gateway-Secret": "", "X-Broker-Tenant": "acme"})


def open_auth() -> Authenticator:
    return Authenticator(AuthSettings(mode="open", default_tenant="dev"), tiers=TIERS, default_tier="standard")


def test_open_mode_is_the_default_tenant_in_standard_unless_the_tier_header_says_otherwise():
    auth = open_auth()
    caller = auth.authenticate({"X-Broker-Tenant": "someone-else"})
    assert (caller.tenant, caller.tier, caller.key_id) == ("dev", "standard", None)
    assert auth.authenticate({"X-Broker-Tier": "realtime"}).tier == "realtime"
