"""Where a job goes and which partitions a worker should hold: pure functions over names and counts.

A job's partition is a stable hash of its merge key (of its flight key when it cannot merge), so
every request that could share a window or a call lands on the one worker that holds the partition.
Each tier has its own stream per partition, so a worker can read realtime before standard before batch.

Every key of a cluster is under one Redis Cluster hash tag, its prefix (`Keys`): a worker reads all its
partition streams in one XREADGROUP, and the marker and claim scripts reach keys they derive from a stream's
name, so nothing narrower keeps them in one slot. On a Redis Cluster, cluster mode therefore lives on one
shard (correctness first); the cache and stored responses, which need no such grouping, still spread.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

from mergebroker.redis_connect import has_hash_tag

GROUP = "workers"  # the one consumer group of every job stream


def stable_hash(text: str) -> int:
    """A hash that is the same in every process (Python's `hash` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def partition_of(key: str, partitions: int) -> int:
    """The partition of a merge (or flight) key."""
    return stable_hash(key) % partitions


def flight_key(tenant: str, tier: str, mergeable: bool, body: dict[str, Any]) -> str:
    """The key under which a worker coalesces identical jobs from any front-end.

    Stricter than the front-end's fingerprint (the exact body, the tenant always): two jobs share an
    answer only when nothing about them differs, whatever the merge scope.
    """
    doc = json.dumps([tenant, tier, mergeable, body], sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(doc.encode(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class Keys:
    """Every Redis key of a cluster, under one prefix that is a hash tag: `mb:cluster` becomes `{mb:cluster}`
    (a prefix that holds a tag already is kept), so `{mb:cluster}:jobs:standard:3`."""

    prefix: str

    def __post_init__(self) -> None:
        if not has_hash_tag(self.prefix):
            object.__setattr__(self, "prefix", "{" + self.prefix + "}")

    def jobs(self, tier: str, partition: int) -> str:
        return f"{self.prefix}:jobs:{tier}:{partition}"

    def lease(self, partition: int) -> str:
        return f"{self.prefix}:lease:{partition}"

    def replies(self, frontend_id: str) -> str:
        return f"{self.prefix}:replies:{frontend_id}"

    def sent_prefix(self, stream: str) -> str:
        """Where the sent markers of `stream`'s entries live: this prefix followed by the entry ID."""
        return f"{self.prefix}:sent:{stream.rpartition(':jobs:')[2]}:"

    def sent(self, stream: str, entry_id: bytes | str) -> str:
        """The marker a worker sets when it sends the entry's job upstream (value: the worker's ID)."""
        return self.sent_prefix(stream) + (entry_id.decode() if isinstance(entry_id, bytes) else entry_id)

    @property
    def presence(self) -> str:
        """A hash: worker ID -> the Redis client ID of the connection that says it is alive (`presence`)."""
        return f"{self.prefix}:presence"

    @property
    def workers(self) -> str:
        """A sorted set: worker ID -> last renewal (server ms); its live members share the partitions."""
        return f"{self.prefix}:workers"


def fair_share(partitions: int, live_workers: int) -> int:
    """How many partitions one worker should hold: an even split, rounded up so none is left over."""
    return math.ceil(partitions / max(1, live_workers))


def preferred_order(worker_id: str, partitions: int) -> list[int]:
    """The order in which a worker tries partitions: all of them, from a starting point of its own,
    so workers starting together do not all race for partition 0."""
    start = stable_hash(worker_id) % partitions
    return [(start + i) % partitions for i in range(partitions)]


def lease_plan(owned: set[int], target: int, order: list[int]) -> tuple[list[int], list[int]]:
    """(partitions to try to acquire, in order; partitions to give up) to reach `target`.

    A worker above its share gives up the ones latest in its own order, so the partitions it keeps
    are stable as the cluster grows and shrinks.
    """
    if len(owned) > target:
        mine = [p for p in order if p in owned]
        return [], mine[target:]
    return [p for p in order if p not in owned], []
