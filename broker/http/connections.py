"""Client connections: bounded header, body and idle times, and a per-process connection cap.

A slow client must not hold a file descriptor forever, and a flood of them must not starve the accept
loop: every accepted connection is tracked here by a thin protocol wrapper around aiohttp's own
handler (only public asyncio `Protocol` calls pass through it). The decisions are pure functions:
`expired(conn, now, limits)` names why a connection must close, and `eviction_order(conns)` ranks
whom to close when the cap is reached: connections with incomplete headers first, then bodies still
arriving, then idle keep-alive connections, the longest-waiting first. A request whose body has
arrived is never evicted: it is being served. When nothing can be evicted, the new connection is
closed at once, so the cap always holds and descriptors stay free for upstreams, Redis and logs.
"""

from __future__ import annotations

import asyncio
import resource
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import structlog

from mergebroker.clock import Clock, Sleep, monotonic

log = structlog.get_logger(__name__)

SWEEP_INTERVAL_S = 0.5
"""How often expired connections are looked for; the timeouts are honoured to within this."""

OnClose = Callable[[str], None]
"""Told the reason ("header_timeout", "body_timeout", "idle_timeout", "evicted", "refused") of each close."""


@dataclass(frozen=True)
class ConnectionLimits:
    """The bounds every client connection lives within (see `ServerSettings` for their meaning)."""

    max_connections: int
    header_timeout_s: float
    body_timeout_s: float
    idle_timeout_s: float


def auto_max_connections(reserved_fds: int, *, nofile: int | None = None) -> int:
    """A connection cap below the process's open-file limit, leaving `reserved_fds` for everything else."""
    if nofile is None:
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if nofile == resource.RLIM_INFINITY:
            nofile = 1 << 20
    return max(16, nofile - reserved_fds)


@dataclass(eq=False)
class Conn:
    """One client connection's state, as far as the limits care."""

    key: Any  # aiohttp's protocol for this connection
    transport: asyncio.BaseTransport
    waiting_since: float  # when it last began waiting for a request (accept, or the end of a response)
    headers_since: float | None = None  # when the first bytes of its next request arrived (headers incomplete)
    request_since: float | None = None  # when its current request began being handled
    body_done: Callable[[], bool] = field(default=lambda: True)

    def stage(self) -> str:
        """"headers" (incomplete), "body" (still arriving), "idle" (keep-alive) or "busy" (being served)."""
        if self.request_since is None:
            return "idle" if self.headers_since is None else "headers"
        return "busy" if self.body_done() else "body"


def expired(conn: Conn, now: float, limits: ConnectionLimits) -> str | None:
    """Why `conn` must close now, or None."""
    stage = conn.stage()
    # The header time counts from the request's first byte, not from the end of the last response: a keep-alive
    # connection that idled past header_timeout_s and then sent a request was closed under it when the sweep ran
    # before the handler started, a loss the client sees as a server disconnect.
    if stage == "headers" and conn.headers_since is not None and now - conn.headers_since > limits.header_timeout_s:
        return "header_timeout"
    if stage == "idle" and now - conn.waiting_since > limits.idle_timeout_s:
        return "idle_timeout"
    if stage == "body" and conn.request_since is not None and now - conn.request_since > limits.body_timeout_s:
        return "body_timeout"
    return None


_EVICT_FIRST = {"headers": 0, "body": 1, "idle": 2}


def eviction_order(conns: Iterable[Conn]) -> list[Conn]:
    """The connections that may be closed to make room, the first to close first."""
    candidates = [c for c in conns if c.stage() in _EVICT_FIRST]
    return sorted(candidates, key=lambda c: (_EVICT_FIRST[c.stage()], c.request_since or c.headers_since or c.waiting_since))


class ConnectionGuard:
    """Tracks every client connection; enforces the cap on accept and the timeouts in `sweep()`."""

    def __init__(self, limits: ConnectionLimits, *, clock: Clock = monotonic,
                 on_close: OnClose | None = None) -> None:
        self.limits = limits
        self._clock = clock
        self._on_close = on_close or (lambda reason: None)
        self._conns: dict[Any, Conn] = {}  # keyed by aiohttp's protocol (what `request.protocol` returns)

    def observe(self, on_close: OnClose) -> None:
        """Report each close's reason to `on_close` from now on (the metrics, once they exist)."""
        self._on_close = on_close

    def __len__(self) -> int:
        return len(self._conns)

    def stages(self) -> Counter[str]:
        """How many connections are at each stage ("headers", "body", "idle", "busy") now."""
        return Counter(conn.stage() for conn in self._conns.values())

    def protocol_factory(self, inner: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """Wrap a server's protocol factory so that its connections are tracked and bounded."""
        return lambda: _GuardedProtocol(self, inner())

    def opened(self, protocol: Any, transport: asyncio.BaseTransport) -> bool:
        """Admit a new connection, closing others (or refusing this one) when the cap is reached."""
        if len(self._conns) >= self.limits.max_connections:
            victims = eviction_order(self._conns.values())
            if not victims:
                self._close(transport, "refused")
                return False
            self._drop(victims[0], "evicted")
        self._conns[protocol] = Conn(protocol, transport, waiting_since=self._clock())
        return True

    def closed(self, protocol: Any) -> None:
        """Forget a connection the peer or the server closed."""
        self._conns.pop(protocol, None)

    def received(self, protocol: Any) -> None:
        """Bytes arrived: while waiting for a request, they are the start of its headers."""
        conn = self._conns.get(protocol)
        if conn is not None and conn.request_since is None and conn.headers_since is None:
            conn.headers_since = self._clock()

    def request_started(self, protocol: Any, body_done: Callable[[], bool]) -> None:
        """A request's headers are complete and it is being handled; `body_done()` says if its body is in."""
        conn = self._conns.get(protocol)
        if conn is not None:
            conn.request_since, conn.body_done = self._clock(), body_done

    def request_finished(self, protocol: Any) -> None:
        """A response was produced: the connection waits for its next request (keep-alive)."""
        conn = self._conns.get(protocol)
        if conn is not None:
            conn.request_since, conn.headers_since, conn.waiting_since = None, None, self._clock()

    def sweep(self) -> int:
        """Close every connection past its limit; the number closed."""
        now = self._clock()
        due = [(c, reason) for c in self._conns.values() if (reason := expired(c, now, self.limits))]
        for conn, reason in due:
            self._drop(conn, reason)
        return len(due)

    async def run(self, sleep: Sleep = asyncio.sleep, interval_s: float = SWEEP_INTERVAL_S) -> None:
        """Sweep forever (a background task of the app)."""
        while True:
            await sleep(interval_s)
            self.sweep()

    def _drop(self, conn: Conn, reason: str) -> None:
        self._conns.pop(conn.key, None)
        self._close(conn.transport, reason)

    def _close(self, transport: asyncio.BaseTransport, reason: str) -> None:
        # abort(): a stalled peer would never drain a graceful close, and the descriptor is what we need.
        abort = getattr(transport, "abort", transport.close)
        abort()
        self._on_close(reason)


class _GuardedProtocol(asyncio.Protocol):
    """aiohttp's request handler with the guard told of each connection's life (delegates everything)."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self._guard = guard
        self._inner = inner
        self._admitted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._admitted = self._guard.opened(self._inner, transport)
        if self._admitted:
            self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self._admitted:
            return
        self._guard.received(self._inner)
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._guard.closed(self._inner)
        if self._admitted:
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()
