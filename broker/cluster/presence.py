"""Presence: telling a dead worker from a paused one, through the one connection it keeps open to Redis.

Silence alone cannot tell them apart: a worker killed with kill -9 and one stopped by SIGSTOP (a VM
migration, a long GC pause) both stop renewing. The kernel can: a dead process's sockets are closed,
so Redis drops its connections at once, while a paused process's connections stay open. Each worker
holds one named connection for this (`make_presence_client`) and registers its Redis client ID under
`Keys.presence`; the others look for that ID with `CLIENT LIST ID` (one cheap command, Redis 6.2+).

A worker whose registered connection is gone is dead once it has been missing for `confirm_s`
(`DeathWatch`): a live worker whose connection merely dropped reconnects and registers again within
one presence period, and it stops sending jobs upstream as soon as its presence fails (the consumer's
fence), before anyone can call it dead. A dead worker's jobs are claimed at once, those it had sent
upstream too: it can never answer them. A worker that is only paused keeps its jobs that went upstream
(no one runs them twice); it loses the others by the claim rule (`claims`).

On a Redis Cluster the connection that counts is the one to the node serving the cluster's hash tag
(`partition.Keys`): `CLIENT ID` and `CLIENT LIST` go to the node of `Keys.presence`. A failover moves
the slot to a node that knows no worker's ID; each registers again within one presence period, and the
confirmation window (`confirm_s`, two periods) leaves room for that.

A host that vanishes without closing its sockets looks paused until Redis notices (its `tcp-keepalive`,
300 s by default): its unsent jobs move after `claim_idle_ms`, its sent ones wait for their deadline.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ResponseError

from mergebroker.broker.cluster.partition import Keys
from mergebroker.redis_connect import PoolOptions, RedisClient, connect, routed_to

PRESENCE_S = 0.25  # how often a worker refreshes its presence and looks for dead workers
CONFIRM_PERIODS = 2  # a registered connection missing this many periods in a row means a dead worker


def make_presence_client(url: str, worker_id: str) -> RedisClient:
    """One connection, named after the worker, used only to be seen (and to register its client ID).

    One immediate retry on a connection error: a connection dropped by a restart reconnects at once
    (with a new client ID, which the next `Presence.refresh` registers); behind Sentinel it reconnects
    to the new master. On a Redis Cluster: one connection per node, of which only the tag's node is used.
    """
    return connect(url, PoolOptions(single_connection_client=True, client_name=worker_id,
                                    socket_connect_timeout_s=0.5, socket_timeout_s=2.0, retry=Retry(NoBackoff(), 1)))


class Presence:
    """A worker's own side: keep its named connection registered under its current client ID."""

    def __init__(self, client: Any, keys: Keys, worker_id: str) -> None:
        self._client = client
        self._keys = keys
        self._id = worker_id
        self._registered: int | None = None

    async def refresh(self) -> None:
        """Register the connection's current client ID (it changes on a reconnect, and a restarted Redis
        forgot it). Raises the client's error when the connection cannot be used: the worker must then
        stop sending upstream."""
        client_id = int(await self._client.client_id(**await routed_to(self._client, self._keys.presence)))
        await self._client.hset(self._keys.presence, self._id, client_id)
        self._registered = client_id

    async def withdraw(self) -> None:
        """A clean stop: nothing to watch for any more."""
        await self._client.hdel(self._keys.presence, self._id)
        self._registered = None

    async def aclose(self) -> None:
        await self._client.aclose()


async def absent_workers(redis_client: Any, keys: Keys, *, me: str) -> set[str]:
    """Registered workers (other than `me`) whose presence connection Redis no longer has.

    An empty set when Redis refuses `CLIENT LIST` (a managed Redis may): presence is then unknown, and
    silent workers lose their jobs by the claim rule alone.
    """
    registered = {_text(w): _text(c) for w, c in (await redis_client.hgetall(keys.presence)).items()}
    registered.pop(me, None)
    if not registered:
        return set()
    try:
        listed = await redis_client.client_list(client_id=list(registered.values()),
                                                **await routed_to(redis_client, keys.presence))
    except ResponseError:
        return set()
    present = {(str(c.get("id")), c.get("name")) for c in listed}
    return {w for w, client_id in registered.items() if (client_id, w) not in present}


class DeathWatch:
    """Which absent workers are dead: absent in every check for at least `confirm_s` (pure, clock given)."""

    def __init__(self, confirm_s: float = PRESENCE_S * CONFIRM_PERIODS) -> None:
        self._confirm_s = confirm_s
        self._absent_since: dict[str, float] = {}

    def observe(self, absent: Collection[str], now: float) -> set[str]:
        """Record one check's absent workers; return those now confirmed dead (each reported once)."""
        for worker in list(self._absent_since):
            if worker not in absent:
                del self._absent_since[worker]  # back (it reconnected and registered again)
        dead = set()
        for worker in absent:
            since = self._absent_since.setdefault(worker, now)
            if now - since >= self._confirm_s:
                dead.add(worker)
        for worker in dead:
            self._absent_since.pop(worker)
        return dead


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
