"""The process's garbage-collection policy: no long stop-the-world pass on the event loop.

CPython's cycle collector stops every thread for a pass (a worker thread's pass blocks the loop too: it
holds the GIL), and a full pass (the oldest generation) walks every tracked object that is not frozen, at
about 0.6 us each on a busy two-core host (1.6 us each for objects it frees). Two kinds of objects made
those passes long, and the policy keeps each out of them:

- Start-up objects (modules, settings, a loaded model) live as long as the process; a full pass over them
  paused the loop ~55 ms. `start_up` collects once and freezes them (`gc.freeze`): they leave the
  collector's generations for good, and a higher young threshold makes young passes rarer.
- Requests in flight. A passthrough request holds ~200-350 tracked objects while it waits on its upstream
  (the server's request, the client's response, tasks, futures, dicts), and it makes no cyclic garbage:
  they all die by reference counting. A young pass is due each time the tracked objects alive grow by the
  young threshold since the last pass, so at the 5,000 this policy first set, passes came as soon as some
  20-60 requests were in flight, walked only live objects (found 0 garbage in every pass measured) and
  moved them to the middle generation for the next passes to walk again: 10-34 us of CPU per request at
  64 in flight and ~100 us at 256, growing with concurrency, while a request costs ~800 us. At 20,000 the
  same runs made no pass at 64 and 15-21 us per request at 256. The price: a young
  pass, when one comes, walks up to 20,000 objects (~15 ms here) instead of 5,000 (~4-6 ms), at most a
  tenth as often.
- A large bulk job holds ~5 tracked objects per line (the line, its body, its messages, its planned item
  and merge shape): 250,000 for a 50,000-line job, alive until the job ends. A full pass due while they
  live walks them all for nothing (none is garbage), and gets longer as the job grows. While holders
  (`hold`) together weigh `pause_from` or more, automatic full passes are paused. Young passes go on, so
  cycles made by live requests are still freed young, and the middle generation is passed every second
  young pass instead of every tenth (`held_young`): one such pass walks at most ~15,000 objects instead
  of ~55,000 while a job's objects pour through it (the same work in smaller pieces: each object is
  walked once per young generation either way). When the weight held falls below `pause_from` again (a
  job ended), the thresholds come back and one full pass runs at once, at that chosen point, so what the
  work left behind (and any older cycle that died meanwhile) is given back then, not at a random moment.

Why not freeze a job's objects instead: a frozen object is never collected, so any cycle among a job's
objects would outlive the job until an unfreeze, and the pass after an unfreeze walks the start-up
objects as well. Pausing gives the same protection with neither cost.

What no policy can shorten: a pass that frees a job's objects walks them all (~0.3 s for 50,000 lines),
so a job's objects must die by reference counting when it ends (no reference cycle reaches them), not
in a pass. Even then, freeing 50,000 lines at once takes ~60 ms: `let_go` frees a large list a slice per
loop turn.

The cost of the pause: a cycle that outlived two young passes and died while large work is held waits
for the end of that work. The policy is process-wide (the collector is), so one instance (`PROCESS`)
serves every component; tests build their own over a fake collector.
"""

from __future__ import annotations

import asyncio
import gc
import threading
from types import TracebackType
from typing import Any, Protocol, Self

__all__ = ["PAUSED", "YOUNG_THRESHOLD", "PROCESS", "Collector", "GcPolicy", "Hold", "let_go"]

PAUSED = 2**31 - 1
"""A full-pass threshold no count of young passes reaches."""
YOUNG_THRESHOLD = 20_000
"""Tracked objects alive past the last pass that make a young pass due: more than ~64 requests in flight
hold (module docstring)."""


class Collector(Protocol):
    """The part of the `gc` module the policy drives: the module itself, or a fake that records calls."""

    def collect(self, generation: int = 2) -> int:
        """Run a pass over `generation` and the younger ones; how many objects it found unreachable."""

    def freeze(self) -> None:
        """Move every tracked object out of the generations, into the permanent one."""

    def set_threshold(self, threshold0: int, threshold1: int = ..., threshold2: int = ..., /) -> None:
        """Set when each generation's automatic pass is due."""


class Hold:
    """One holder's share of the weight held; `release` (or leaving the `with` block) gives it back, once."""

    def __init__(self, policy: GcPolicy, weight: int) -> None:
        self._policy = policy
        self.weight = weight

    def release(self) -> None:
        """Give the weight back; safe to call twice."""
        weight, self.weight = self.weight, 0
        if weight:
            self._policy._change(-weight)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


class GcPolicy:
    """Start-up objects frozen; automatic full passes paused while large work is held (module docstring)."""

    def __init__(self, collector: Collector = gc, *, young: tuple[int, int] = (YOUNG_THRESHOLD, 10), full: int = 10,
                 held_young: tuple[int, int] = (5000, 2), pause_from: int = 10_000) -> None:
        self._gc = collector
        self._young = young
        self._held_young = held_young
        self._full = full
        self.pause_from = pause_from
        """The weight held (for bulk jobs: their lines) from which full passes pause."""
        self._held = 0
        self._lock = threading.Lock()  # loops in other threads (the library's users) may hold too
        self.paused = False

    @property
    def held(self) -> int:
        """The weight held now."""
        return self._held

    def start_up(self) -> None:
        """Collect once, freeze everything alive (start-up objects), and set the thresholds."""
        self._gc.collect()
        self._gc.freeze()
        self._apply()

    def hold(self, weight: int) -> Hold:
        """Hold `weight` (a bulk job: its lines) until the `Hold` is released; pauses full passes while the
        weight held reaches `pause_from`."""
        self._change(weight)
        return Hold(self, weight)

    def _change(self, delta: int) -> None:
        with self._lock:
            self._held += delta
            pause = self._held >= self.pause_from
            if pause == self.paused:
                return
            self.paused = pause
            self._apply()
            if not pause:
                self._gc.collect()  # the pass the pause held back, now, while nothing large is alive

    def _apply(self) -> None:
        if self.paused:
            self._gc.set_threshold(*self._held_young, PAUSED)
        else:
            self._gc.set_threshold(*self._young, self._full)


PROCESS = GcPolicy()
"""The policy of this process (there is one collector per process)."""


async def let_go(items: list[Any], *, step: int = 5_000) -> None:
    """Empty `items` from the end, `step` at a time with a loop turn between, so what only the list kept
    alive is freed in slices (~6 ms each for a bulk job's lines) instead of all at once."""
    while items:
        del items[-step:]
        await asyncio.sleep(0)  # a turn for the loop's other work, not a wait
