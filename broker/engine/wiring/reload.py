"""Config reload without a restart: re-read, validate whole, swap the engine atomically, retire the old one.

`changes(old, new)` is the diff (pure): every setting that differs, by dotted path, secrets masked. Some
settings belong to the process, not the engine (the listen address, storage paths, Redis, cluster mode,
the similarity model, logging, telemetry): `fixed(changes)` names those, and a reload that touches them is
refused with their names. Everything else — keys and tenants, tiers and their limits, providers and pools,
merging, the cache, pricing and model maps — is applied by building a new engine that shares the old one's
process-wide parts (`assemble(keep=old)`) and swapping it in: requests that arrive after the swap use the
new settings, while requests, open merge windows and streams already running finish on the engine they
started on, which is stopped once it is idle (or after `server.drain_timeout_s`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from mergebroker.broker.engine.container import Engine
from mergebroker.broker.engine.ground.config import ConfigError
from mergebroker.broker.engine.ground.settings import Settings
from mergebroker.clock import Clock, Sleep, monotonic

log = structlog.get_logger(__name__)

FIXED_SECTIONS = ("server", "ledger", "responses", "redis", "cluster", "embeddings", "logging", "telemetry", "mcp")
"""Settings a running process cannot change: they shape its sockets, files, connections and loaded model."""
FIXED_FIELDS = ("merge.embedder",)
_SECRET_WORDS = ("key", "secret", "password", "token", "dsn", "sha256")
_IDLE_POLL_S = 0.1


@dataclass(frozen=True)
class Change:
    """One setting that differs: its dotted path and both values as shown in logs (secrets masked)."""

    path: str
    old: Any
    new: Any


@dataclass(frozen=True)
class ReloadResult:
    """What a reload did: `applied`, `unchanged` or `refused` (with the reason), and the changes."""

    result: str
    changes: tuple[Change, ...] = ()
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"result": self.result, "reason": self.reason or None,
                "changes": [{"path": c.path, "old": c.old, "new": c.new} for c in self.changes]}


def changes(old: Settings, new: Settings) -> list[Change]:
    """Every setting that differs between `old` and `new`, in path order."""
    before, after = _flat(old.model_dump(mode="json")), _flat(new.model_dump(mode="json"))
    missing = object()
    diff = []
    for path in sorted(before.keys() | after.keys()):
        a, b = before.get(path, missing), after.get(path, missing)
        if a != b:
            diff.append(Change(path, _shown(path, a, missing), _shown(path, b, missing)))
    return diff


def fixed(diff: list[Change]) -> list[str]:
    """The paths in `diff` that only a restart can apply."""
    return [c.path for c in diff
            if c.path.split(".")[0].split("[")[0] in FIXED_SECTIONS or c.path in FIXED_FIELDS]


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flat(item, f"{prefix}.{key}" if prefix else str(key)))
        return out or {prefix: {}}
    if isinstance(value, list) and value and all(isinstance(v, dict) and "name" in v for v in value):
        # Named entries (providers, tiers) diff by name, so adding one does not shift every other.
        return {k: v for item in value for k, v in _flat(item, f"{prefix}[{item['name']}]").items()}
    return {prefix: value}


def _shown(path: str, value: Any, missing: object) -> Any:
    if value is missing:
        return None
    last = path.rsplit(".", 1)[-1].lower()
    if any(word in last for word in _SECRET_WORDS) and not last.endswith("_env"):
        return "***"  # the name of an environment variable is not a secret; its value, a key or a hash is
    return value


@dataclass
class Reloader:
    """Serialises reloads of one running engine.

    `load` re-reads and validates the configuration (raising `ConfigError` with the reason); `build` makes the
    successor engine from new settings and the running one; `swap` puts it in place for new requests;
    `retire` stops a replaced engine's own parts; `idle` says whether an engine has nothing in flight.
    """

    load: Callable[[], Settings]
    current: Callable[[], Engine]
    build: Callable[[Settings, Engine], Awaitable[Engine]]
    swap: Callable[[Engine], None]
    retire: Callable[[Engine, Engine], Awaitable[None]]
    idle: Callable[[Engine], bool]
    on_result: Callable[[ReloadResult], None] = lambda result: None
    clock: Clock = monotonic
    sleep: Sleep = asyncio.sleep
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _retiring: set[asyncio.Task[None]] = field(default_factory=set)
    _closing: bool = False

    async def reload(self, trigger: str) -> ReloadResult:
        """Re-read the configuration and apply it, or refuse it and keep the running one."""
        async with self._lock:
            result = await self._reload()
        log_event = log.info if result.result != "refused" else log.warning
        log_event("config_reload", trigger=trigger, result=result.result, reason=result.reason or None,
                  changes=[f"{c.path}: {c.old!r} -> {c.new!r}" for c in result.changes])
        self.on_result(result)
        return result

    async def _reload(self) -> ReloadResult:
        old = self.current()
        try:
            settings = self.load()
        except ConfigError as exc:
            return ReloadResult("refused", reason=str(exc))
        diff = changes(old.settings, settings)
        if not diff:
            return ReloadResult("unchanged")
        needs_restart = fixed(diff)
        if needs_restart:
            return ReloadResult("refused", tuple(diff), "these settings change only with a restart: "
                                + ", ".join(needs_restart))
        try:
            new = await self.build(settings, old)
        except (ConfigError, ValueError, OSError) as exc:
            return ReloadResult("refused", tuple(diff), f"the new configuration could not be started: {exc}")
        self.swap(new)
        task = asyncio.ensure_future(self._retire(old, new, settings.server.drain_timeout_s))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)
        return ReloadResult("applied", tuple(diff))

    async def _retire(self, old: Engine, new: Engine, timeout_s: float) -> None:
        """Stop `old` once nothing runs on it (its open windows closed, its calls and streams done)."""
        deadline = self.clock() + timeout_s
        while not self._closing and self.clock() < deadline and not (self.idle(old) and await self._still_idle(old)):
            await self.sleep(_IDLE_POLL_S)
        await self.retire(old, new)
        log.info("engine_retired", idle=self.idle(old))

    async def _still_idle(self, engine: Engine) -> bool:
        await self.sleep(_IDLE_POLL_S)  # a request that took the old engine just before the swap gets to start
        return self.idle(engine)

    async def retired(self) -> None:
        """Wait until every engine replaced so far has been retired (each once it went idle)."""
        await asyncio.gather(*self._retiring, return_exceptions=True)

    async def close(self) -> None:
        """Retire replaced engines now (at shutdown, after the drain: what ran on them has finished)."""
        self._closing = True
        await asyncio.gather(*self._retiring, return_exceptions=True)


def engine_idle(engine: Engine) -> bool:
    """Nothing in flight on `engine`: no job waits in its windows and no call is out on its pools."""
    waiting = sum(engine.queue.depth(t.name) for t in engine.settings.tiers)
    calling = sum(u.in_flight for u in engine.pools.upstreams)
    return waiting == 0 and calling == 0
