"""Live requests and bulk lines become mergeable units by one rule (`merge.mergeable.UnitRules`): the same
scope (`merge.scope`, all four kinds in both), temperature default, fingerprint, merge key and budget."""

from __future__ import annotations

import pytest

from mergebroker.broker.bulk.items import ItemContext, bulk_items
from mergebroker.broker.bulk.lines import BatchLine
from mergebroker.broker.engine.chat.service import ChatService
from mergebroker.broker.engine.ground.config import load_settings
from mergebroker.broker.engine.limits.admission import Caller
from mergebroker.merge.mergeable import UnitRules

BODY = {"model": "m", "user": "u1", "messages": [{"role": "user", "content": "What is the boiling point of water?"}]}


def test_each_scope_keeps_apart_whom_it_names_and_no_name_spells_another():
    def scope(kind: str, tenant: str = "t", tier: str = "batch", user: str | None = "u") -> str:
        return UnitRules(scope=kind).scope_of(tenant=tenant, tier=tier, user=user)

    assert scope("global") == scope("global", "other", "realtime", "v") == "global"
    assert scope("tier") == scope("tier", "other", user="v") != scope("tier", tier="realtime")
    assert scope("tenant") == scope("tenant", tier="realtime", user="v") != scope("tenant", "other")
    assert scope("user") != scope("user", user="v") and scope("user", user=None) == scope("user", user="")
    assert scope("tenant", 'a", "b') != scope("user", "a", user="b")  # JSON-encoded names


def test_an_omitted_temperature_is_zero_only_where_the_tier_says_so():
    assert UnitRules(omitted_temperature_is_zero=True).read(BODY)["temperature"] == 0
    assert UnitRules(omitted_temperature_is_zero=True).read({**BODY, "temperature": 0.7})["temperature"] == 0.7
    assert "temperature" not in UnitRules().read(BODY)


def test_a_stream_merges_only_with_streams_and_an_opt_out_or_a_tier_without_merging_never():
    rules = UnitRules()
    shape, key = rules.identity(BODY, "s")
    stream_shape, stream_key = rules.identity({**BODY, "stream": True, "stream_options": {}}, "s", stream=True)
    assert shape == stream_shape and stream_key == key + "|stream"
    assert rules.identity(BODY, "s", mergeable=False) == (None, None)
    assert UnitRules(merging=False).identity(BODY, "s") == (None, None)
    assert rules.identity(BODY, "s")[1] != rules.identity(BODY, "other")[1]


@pytest.mark.parametrize("scope", ["tenant", "user", "tier", "global"])
async def test_a_bulk_line_is_the_unit_a_live_request_of_the_same_tenant_user_and_tier_is(scope):
    settings = load_settings(None, environ={}, overrides={"merge": {"scope": scope, "embedder": "none"}})
    tier = settings.tier(settings.batch_tier())
    ctx = ItemContext(settings, tier.name, "t", frozenset({"m"}), frozenset({"m"}))
    [item], refused = bulk_items([BatchLine("c1", "/v1/chat/completions", BODY)], ctx)
    assert not refused
    # The live path's own steps, as `ChatService.complete` takes them (nothing here needs its collaborators).
    service = ChatService(settings, queue=None, pools=None, limiter=None, cache=None, metrics=None)  # type: ignore
    caller = Caller(tenant="t", tier=tier.name, user="u1")
    body = service._units[tier.name].read(BODY)
    scope_value = service._scope(caller, tier)
    job = service._job(caller, tier, scope_value, "r1", body, 10.0, 0, 0, False)
    assert (item.body, item.fingerprint, item.shape, item.merge_key, item.max_tokens) == (
        body, service._units[tier.name].fingerprint(body, scope_value), job.shape, job.merge_key,
        service._units[tier.name].budget(body))
    assert item.fingerprint.startswith({"tenant": "tenant:", "user": "user:", "tier": "tier:",
                                        "global": "global:"}[scope])
