"""The jobs a front-end has sent to the cluster and awaits, by correlation ID, and which of them went upstream.

A worker notes every job it sends upstream (`WireReply.sent_by`), in the same script that marks it sent
(`markers`). When the front-end has to serve its jobs itself (Redis lost, no live worker), it hands back
only those no worker will answer: the ones noted by a worker found dead at once (`release_noted_by`); the
ones never noted once it has made sure no worker can still note them (`hold_unnoted`, then the front-end's
hand-over: it deletes their entries, reads its replies, and releases what is still un-noted), or once
their wait runs out while Redis stays away (`release_overdue`). A noted job of a live (or unknown) worker
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
    release_by: float | None = None  # held for a hand-over: served here by then at the latest (local clock)


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

    def release_noted_by(self, dead: Collection[str]) -> tuple[list[ChatJob], list[tuple[str, Any]]]:
        """Stop awaiting the jobs noted by a worker in `dead`: their jobs, to serve elsewhere, and their
        entries, to take back from the streams."""
        return self._release([cid for cid, a in self._by_cid.items() if a.sent_by is not None and a.sent_by in dead])

    def hold_unnoted(self, now: float, wait_s: float) -> None:
        """Un-noted jobs wait for a hand-over, for `wait_s` at most and half their remaining time at most (so
        the local queue still has time to serve them)."""
        for a in self._by_cid.values():
            if a.sent_by is None and a.release_by is None:
                a.release_by = now + max(0.0, min(wait_s, (a.job.deadline - now) / 2))

    def held(self) -> list[str]:
        """The correlation IDs of the jobs held for a hand-over and still un-noted."""
        return [cid for cid, a in self._by_cid.items() if a.release_by is not None and a.sent_by is None]

    def entries_of(self, cids: Collection[str]) -> list[tuple[str, Any]]:
        """Where the jobs of `cids` still awaited were added (those whose add went through)."""
        found = (self._by_cid.get(cid) for cid in cids)
        return [a.entry for a in found if a is not None and a.entry is not None]

    def release_unnoted(self, cids: Collection[str]) -> list[ChatJob]:
        """Stop awaiting the jobs of `cids` still awaited and un-noted (their entries were taken back)."""
        return self._release([cid for cid in cids if (a := self._by_cid.get(cid)) is not None and a.sent_by is None])[0]

    def release_overdue(self, now: float) -> tuple[list[ChatJob], list[tuple[str, Any]]]:
        """Stop awaiting the held, un-noted jobs whose wait ran out: served elsewhere, at the risk of a second
        upstream call, rather than not at all."""
        return self._release([cid for cid, a in self._by_cid.items()
                              if a.sent_by is None and a.release_by is not None and a.release_by <= now])

    def _release(self, cids: list[str]) -> tuple[list[ChatJob], list[tuple[str, Any]]]:
        moved = [self._by_cid.pop(cid) for cid in cids]
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
