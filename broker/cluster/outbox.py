"""A worker's writes to Redis, gathered between two round trips and sent as one pipeline.

Order inside a flush: sent markers and sent notes first (another worker deciding a claim, or a front-end
losing Redis, should see them as early as possible), then the usage notes of answers released early,
then each finished entry's reply, its acknowledgement, its deletion and the removal of its marker.
On a Redis error everything stays queued for the next flush.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from mergebroker.broker.cluster.holds import Held
from mergebroker.broker.cluster.partition import GROUP, Keys
from mergebroker.broker.cluster.wire import WireReply, encode_reply

REPLY_MAXLEN = 10_000  # a reply stream is read as it fills; this only bounds an abandoned one
MARKER_GRACE_MS = 60_000  # a sent marker outlives its job's deadline by this much, then expires


@dataclass(frozen=True)
class _Marker:
    stream: str
    entry_id: bytes
    worker: str
    until_ms: int  # Redis server time


class Outbox:
    """Writes waiting for the writer loop; `ready` is set whenever there is something to send."""

    def __init__(self, keys: Keys) -> None:
        self._keys = keys
        self._markers: list[_Marker] = []
        self._notes: list[tuple[str, WireReply]] = []  # (reply stream, message)
        self._finished: list[tuple[Held, WireReply | None]] = []
        self.ready = asyncio.Event()

    def __bool__(self) -> bool:
        return bool(self._markers or self._notes or self._finished)

    def sent(self, held: Held, worker: str, until_ms: int) -> None:
        """`held`'s job went upstream: mark its entry and tell its front-end."""
        self._markers.append(_Marker(held.stream, held.entry_id, worker, until_ms))
        self._notes.append((held.job.reply_to, WireReply(held.job.correlation_id, sent_by=worker)))
        self.ready.set()

    def note(self, reply_to: str, message: WireReply) -> None:
        """A message of its own for a front-end (the usage of an answer released early)."""
        self._notes.append((reply_to, message))
        self.ready.set()

    def finish(self, held: Held, reply: WireReply | None) -> None:
        """Reply (None: no reply), then acknowledge and delete the entry."""
        self._finished.append((held, reply))
        self.ready.set()

    async def flush(self, redis: Any) -> list[Held]:
        """Send everything queued in one round trip; the entries finished by it. Raises the client's error,
        keeping everything queued."""
        markers, notes, finished = self._markers, self._notes, self._finished
        self._markers, self._notes, self._finished = [], [], []
        self.ready.clear()
        if not (markers or notes or finished):
            return []
        pipe = redis.pipeline(transaction=False)
        for m in markers:
            pipe.set(self._keys.sent(m.stream, m.entry_id), m.worker, pxat=m.until_ms + MARKER_GRACE_MS)
        for reply_to, message in notes:
            pipe.xadd(reply_to, encode_reply(message), maxlen=REPLY_MAXLEN, approximate=True)
        for held, reply in finished:
            if reply is not None:
                pipe.xadd(held.job.reply_to, encode_reply(reply), maxlen=REPLY_MAXLEN, approximate=True)
            pipe.xack(held.stream, GROUP, held.entry_id)
            pipe.xdel(held.stream, held.entry_id)
            pipe.delete(self._keys.sent(held.stream, held.entry_id))
        try:
            await pipe.execute()
        except BaseException:
            self._markers, self._notes, self._finished = markers + self._markers, notes + self._notes, \
                finished + self._finished
            self.ready.set()
            raise
        return [held for held, _reply in finished]
