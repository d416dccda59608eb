"""The token ids of long texts seen before: a conversation re-sent every turn is tokenized once, not every turn.

Agents (Claude Code, Codex CLI) send the whole conversation again on every turn, and applications repeat one
long system prompt on every request. Counting a 15,000-token conversation with o200k_base costs about 2 ms of
the event loop's CPU, on every request, and pricing it for the provider's prompt cache as much again.
Remembered by their text, a turn pays only for its new messages, plus hashing each text (about a gigabyte a
second).

Only texts of at least `min_chars` characters are remembered: a shorter one encodes in a few microseconds, and
remembering every user question would only churn the memo. It holds at most `max_chars` characters of texts
(each with its ids, four bytes a token: about a byte per character of English), and drops the least recently
used first. Thread-safe: counting also runs in worker threads (bulk planning).
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence

MIN_CHARS = 256
MAX_CHARS = 8_000_000


class TokenMemo:
    """Token ids by text, for texts of `min_chars` or more, bounded by `max_chars` characters in all."""

    def __init__(self, *, min_chars: int = MIN_CHARS, max_chars: int = MAX_CHARS) -> None:
        self.min_chars = min_chars
        self._max_chars = max_chars
        self._ids: OrderedDict[str, array[int]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def get(self, text: str) -> array[int] | None:
        """The ids remembered for `text` (now the most recently used), or None."""
        with self._lock:
            ids = self._ids.get(text)
            if ids is not None:
                self._ids.move_to_end(text)
            return ids

    def put(self, text: str, ids: Sequence[int]) -> array[int]:
        """Remember `ids` as the tokens of `text` (if it fits at all); returns them as an array."""
        kept = array("I", ids)  # o200k_base ids fit in 32 bits; a list would hold a 28-byte object per token
        if len(text) > self._max_chars:
            return kept
        with self._lock:
            if text not in self._ids:
                self._ids[text] = kept
                self._chars += len(text)
                while self._chars > self._max_chars:
                    dropped, _ = self._ids.popitem(last=False)
                    self._chars -= len(dropped)
        return kept

    @property
    def chars(self) -> int:
        """Characters of the texts remembered."""
        return self._chars
