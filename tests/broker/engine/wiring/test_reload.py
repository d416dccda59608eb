"""Config reload: the diff names what changed with secrets masked, settings only a restart can change are
refused by name, and a reload swaps in an engine that applies the new tiers and providers while sharing the
old one's metrics, limiter counts and cost totals, then retires the old engine once it is idle."""

from __future__ import annotations

import pytest

from mergebroker.broker.engine.container import Engine
from mergebroker.broker.engine.ground.config import ConfigError, load_settings
from mergebroker.broker.engine.ground.settings import Settings
from mergebroker.broker.engine.wiring.assemble import assemble, stop_engine
from mergebroker.broker.engine.wiring.reload import Reloader, ReloadResult, changes, engine_idle, fixed
from tests.conftest import provider_for

KEY_HASH = "a" * 64


def _settings(**overrides) -> Settings:
    return load_settings(None, environ={}, overrides={"merge": {"embedder": "none"}, **overrides})


def test_changes_name_each_setting_by_path_and_mask_secrets():
    old = _settings(auth={"mode": "keys", "keys": [{"sha256": KEY_HASH, "tenant": "acme"}]},
                    tiers=[{"name": "standard", "rpm": 60}])
    new = _settings(auth={"mode": "keys", "keys": [{"sha256": "b" * 64, "tenant": "acme"}]},
                    tiers=[{"name": "standard", "rpm": 120}], default_tier="standard")
    diff = {c.path: (c.old, c.new) for c in changes(old, new)}
    assert diff["tiers[standard].rpm"] == (60, 120)
    assert diff["auth.keys"] == ("***", "***")  # hashes of keys are never shown
    assert KEY_HASH not in repr(diff)
    assert fixed(changes(old, new)) == []


def test_settings_of_the_process_are_named_as_needing_a_restart():
    diff = changes(_settings(), _settings(server={"port": 9999}, ledger={"path": "/tmp/x.db"}))
    assert sorted(fixed(diff)) == ["ledger.path", "server.port"]


def test_a_provider_added_shows_under_its_name():
    old = _settings(providers=[{"name": "a", "base_url": "http://127.0.0.1:1/v1"}])
    new = _settings(providers=[{"name": "a", "base_url": "http://127.0.0.1:1/v1"},
                               {"name": "b", "base_url": "http://127.0.0.1:2/v1"}])
    paths = [c.path for c in changes(old, new)]
    assert "providers[b].base_url" in paths and not any(p.startswith("providers[a]") for p in paths)


class _Engine:
    """The slot a way in reads its engine from."""

    def __init__(self, broker: Engine) -> None:
        self.broker = broker

    def swap(self, broker: Engine) -> None:
        self.broker = broker


def _reloader(slot: _Engine, load, results: list[ReloadResult]) -> Reloader:
    async def build(settings: Settings, old: Engine) -> Engine:
        return await assemble(settings, keep=old, clock=old.clock)

    async def retire(old: Engine, new: Engine) -> None:
        await stop_engine(old, successor=new)

    return Reloader(load=load, current=lambda: slot.broker, build=build, swap=slot.swap, retire=retire,
                    idle=engine_idle, on_result=results.append)


async def test_a_reload_swaps_in_the_new_tiers_and_providers_and_keeps_the_process_parts(simulator):
    base = {"providers": [provider_for(simulator)], "merge": {"embedder": "none"},
            "tiers": [{"name": "standard", "rpm": 60, "window_ms": 0}], "default_tier": "standard"}
    old = await assemble(load_settings(None, environ={}, overrides=base))
    slot, results = _Engine(old), []
    wanted = {**base, "tiers": [{"name": "standard", "rpm": 600, "window_ms": 0}],
              "providers": [provider_for(simulator), {**provider_for(simulator), "name": "second"}]}
    reloader = _reloader(slot, lambda: load_settings(None, environ={}, overrides=wanted), results)
    try:
        result = await reloader.reload("test")
        assert result.result == "applied"
        new = slot.broker
        assert new is not old and new.settings.tiers[0].rpm == 600
        assert [u.name for u in new.pools.upstreams] == [u.name for u in old.pools.upstreams] + ["second"]
        assert new.metrics is old.metrics and new.limiter is old.limiter and new.costs.totals is old.costs.totals
        assert new.breakers[old.pools.upstreams[0].name] is old.breakers[old.pools.upstreams[0].name]
        await reloader.retired()  # the old engine was idle: retired
        assert not old.queue.alive() and new.queue.alive()
        assert (await reloader.reload("again")).result == "unchanged"
    finally:
        await reloader.close()
        await stop_engine(slot.broker)


async def test_a_config_that_does_not_validate_or_needs_a_restart_is_refused_and_the_engine_stays(simulator):
    base = {"providers": [provider_for(simulator)], "merge": {"embedder": "none"}}
    old = await assemble(load_settings(None, environ={}, overrides=base))
    slot, results = _Engine(old), []
    attempts = iter([ConfigError("tiers.0.rpm: Input should be greater than 0"), {**base, "server": {"port": 1}}])

    def load() -> Settings:
        attempt = next(attempts)
        if isinstance(attempt, Exception):
            raise attempt
        return load_settings(None, environ={}, overrides=attempt)

    reloader = _reloader(slot, load, results)
    try:
        broken = await reloader.reload("test")
        assert broken.result == "refused" and "greater than 0" in broken.reason
        restart = await reloader.reload("test")
        assert restart.result == "refused" and "server.port" in restart.reason
        assert slot.broker is old and old.queue.alive()
        assert [r.result for r in results] == ["refused", "refused"]
    finally:
        await stop_engine(old)


@pytest.mark.parametrize("secret_path", ["auth.keys[0].sha256", "providers[a].api_key", "ledger.postgres_dsn"])
def test_secret_looking_paths_are_masked_but_environment_variable_names_are_not(secret_path):
    from mergebroker.broker.engine.wiring.reload import _shown

    assert _shown(secret_path, "value", object()) == "***"
    assert _shown("providers[a].api_key_env", "OPENAI_KEY", object()) == "OPENAI_KEY"
