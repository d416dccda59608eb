"""The jobs a front-end has sent to the cluster and awaits, by correlation ID, and which of them went upstream.

A worker notes every job it sends upstream (`WireReply.sent_by`). When the front-end has to serve its
jobs itself (Redis lost, no live worker), `release` hands back only those no worker will answer: the
ones never noted, and the ones noted by a worker found dead. A noted job of a live (or unknown) worker
keeps waiting for its reply, which comes when Redis is back; running it here too would send it upstream
twice. Its caller's deadline still bounds the wait.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from mergebroker.broker.engine.chat.jobs import ChatJob


@dataclass
class Awaited:
    """One job sent and not yet answered."""

    job: ChatJob
    sent_at: float  # local clock, for the hop metric
    entry: tuple[str, Any] | None = None  # (stream, entry ID) once the add went through
    sent_by: str | None = None  # the worker that sent it upstream, from its note


class InFlight:
    """Awaited jobs by correlation ID."""

    def __init__(self) -> None:
        self._by_cid: dict[str, Awaited] = {}

    def __len__(self) -> int:
        return len(self._by_cid)

    def __contains__(self, cid: str) -> bool:
        return cid in self._by_cid

    def add(self, cid: str, job: ChatJob, now: float) -> None:
        self._by_cid[cid] = Awaited(job, now)

    def pop(self, cid: str) -> Awaited | None:
        return self._by_cid.pop(cid, None)

    def entry_added(self, cid: str, entry: tuple[str, Any]) -> bool:
        """Record where the job was added; False when it is no longer awaited (answered, moved, abandoned)."""
        awaited = self._by_cid.get(cid)
        if awaited is None or awaited.job.future.done():
            return False
        awaited.entry = entry
        return True

    def note(self, cid: str, worker: str) -> None:
        """A worker sent the job upstream."""
        awaited = self._by_cid.get(cid)
        if awaited is not None:
            awaited.sent_by = worker

    def senders(self) -> set[str]:
        """The workers whose answers are awaited for jobs they sent upstream."""
        return {a.sent_by for a in self._by_cid.values() if a.sent_by is not None}

    def release(self, dead: Collection[str] = ()) -> tuple[list[ChatJob], list[tuple[str, Any]]]:
        """Stop awaiting the jobs no worker will answer (never noted, or noted by a worker in `dead`): their
        jobs, to serve elsewhere, and their entries, to take back from the streams."""
        gone = [cid for cid, a in self._by_cid.items() if a.sent_by is None or a.sent_by in dead]
        moved = [self._by_cid.pop(cid) for cid in gone]
        return [a.job for a in moved], [a.entry for a in moved if a.entry is not None]

    def cids(self) -> list[str]:
        return list(self._by_cid)

    def entries(self) -> list[tuple[str, Any]]:
        """Where the awaited jobs were added (those whose add went through)."""
        return [a.entry for a in self._by_cid.values() if a.entry is not None]

    def jobs(self) -> list[ChatJob]:
        return [a.job for a in self._by_cid.values()]

    def clear(self) -> None:
        self._by_cid.clear()
