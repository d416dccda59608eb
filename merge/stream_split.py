"""Split a merged reply while it streams: feed text deltas, hear of each block's text and of its close.

The rules are `merge.split`'s, applied as the text arrives, so a member can be answered the moment its
block closes instead of when the whole reply has been generated:

- tags are found with `split`'s own reader (`split.tags`); a `<` that may still grow into a tag is held back until
  the next delta shows what it is, so a tag split across deltas is read whole;
- chatter outside blocks is ignored; a block whose ID belongs to no member is never routed;
- a block closes with its stripped text, or with the `BlockFailure` `split_reply` would give: EMPTY,
  FOREIGN_ID, MALFORMED (a garbled tag, a block opened inside it, or closed by another ID's tag);
- at `finish(finish_reason)` every member still without a closed block gets TRUNCATED (its block was
  cut by the token limit; the event carries the text it had), MALFORMED (never closed) or MISSING.

One difference is forced by answering early: a second block for an ID already answered cannot take
the answer back, so it is ignored (the batch splitter calls that DUPLICATED and re-sends the member).

`releasable(text, hold_words)` is the hold-back rule for members that stream their own block: text is
released only up to `hold_words` words before its end, so the leak check has seen every run of
`hold_words` words before any of it leaves.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from mergebroker.merge.split import _TAG_PREFIX, BlockFailure, IdMentions, Tag, tags, without_tag_prefix

_WORD = re.compile(r"\w+")


@dataclass(frozen=True)
class BlockDelta:
    """New text inside the open block of member `id` (raw: not stripped)."""

    id: str
    text: str


@dataclass(frozen=True)
class BlockClosed:
    """Member `id`'s block is over: its stripped answer, or why there is none."""

    id: str
    answer: str | BlockFailure
    partial: str = ""  # TRUNCATED: the block's text so far (left-stripped), which may have reached its budget


StreamEvent = BlockDelta | BlockClosed


@dataclass
class _Open:
    id: str
    parts: list[str] = field(default_factory=list)
    malformed: bool = False


class StreamSplitter:
    """Reads one merged reply incrementally (see the module docstring). Not thread-safe; one per call."""

    def __init__(self, ids: Sequence[str]) -> None:
        self._wanted = {i.lower(): i for i in ids}
        self._mentions = IdMentions(self._wanted)
        self._buffer = ""
        self._open: _Open | None = None
        self._done: set[str] = set()  # lower-case IDs that got their BlockClosed
        self._finished = False

    @property
    def pending(self) -> list[str]:
        """Members (their IDs as given) without a closed block yet."""
        return [original for key, original in self._wanted.items() if key not in self._done]

    def feed(self, delta: str) -> list[StreamEvent]:
        """Take the next piece of the reply; the events it completes, in order."""
        if self._finished:
            raise RuntimeError("feed after finish")
        self._buffer += delta
        hold = _TAG_PREFIX.search(self._buffer, max(0, self._buffer.rfind("<")))
        return self._parse(hold.start() if hold is not None else len(self._buffer))

    def finish(self, finish_reason: str | None) -> list[StreamEvent]:
        """The reply is over: close what is left (see the module docstring for the failure chosen)."""
        events = self._parse(len(self._buffer)) if not self._finished else []  # a held tail is read as it is
        self._finished = True
        block = self._open
        if block is not None and block.id in self._wanted and block.id not in self._done:
            # Still open when the reply stopped at the token limit, even if its own tag was cut short.
            if finish_reason == "length":
                self._closed(block.id, BlockFailure.TRUNCATED, events, partial=without_tag_prefix("".join(block.parts)).lstrip())
            else:
                self._closed(block.id, BlockFailure.MALFORMED, events)
        for key in list(self._wanted):
            if key not in self._done:
                self._closed(key, BlockFailure.MISSING, events)
        return events

    def _parse(self, end: int) -> list[StreamEvent]:
        """Read the buffer up to `end` (tags and text), keep the rest for the next delta."""
        events: list[StreamEvent] = []
        pos = 0
        for match, tag in tags(self._buffer, 0, end):
            self._text(self._buffer[pos:match.start()], events)
            if tag.closing:
                self._close(tag, events)
            else:
                self._start(tag, events)
            pos = match.end()
        self._text(self._buffer[pos:end], events)
        self._buffer = self._buffer[end:]
        return events

    def _text(self, text: str, events: list[StreamEvent]) -> None:
        block = self._open
        if not text or block is None or block.id not in self._wanted or block.id in self._done:
            return
        block.parts.append(text)
        events.append(BlockDelta(self._wanted[block.id], text))

    def _start(self, tag: Tag, events: list[StreamEvent]) -> None:
        outer = self._open
        if outer is not None and outer.id in self._wanted and outer.id not in self._done:
            self._closed(outer.id, BlockFailure.MALFORMED, events)  # a block opened inside it
        self._open = _Open(tag.id, malformed=not tag.clean)

    def _close(self, tag: Tag, events: list[StreamEvent]) -> None:
        block, self._open = self._open, None
        if block is None or block.id not in self._wanted or block.id in self._done:
            return
        if block.malformed or not tag.clean or tag.id != block.id:
            self._closed(block.id, BlockFailure.MALFORMED, events)
            return
        text = "".join(block.parts).strip()
        if not text:
            self._closed(block.id, BlockFailure.EMPTY, events)
        elif self._mentions.others(text, block.id):
            self._closed(block.id, BlockFailure.FOREIGN_ID, events)
        else:
            self._closed(block.id, text, events)

    def _closed(self, key: str, answer: str | BlockFailure, events: list[StreamEvent], partial: str = "") -> None:
        self._done.add(key)
        events.append(BlockClosed(self._wanted[key], answer, partial))


def releasable(text: str, hold_words: int) -> int:
    """How much of a streamed block's text (from its start) may leave now: all but its last `hold_words` words.

    The cut falls where the first held word starts, so released text never ends inside a word that may
    still grow. Leading whitespace counts as released (the answer is stripped).
    """
    if hold_words <= 0:
        return len(text)
    starts = [m.start() for m in _WORD.finditer(text)]
    if len(starts) <= hold_words:
        return 0
    return starts[-hold_words]
