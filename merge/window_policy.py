"""Adaptive merge windows: wait for partners only while one is likely to come.

A request that opens a merge window pays the whole window when no partner arrives. Whether one will
is a question about *other* traffic: a client that sends its next request only after the previous
answer (a sequential client, an interactive user) can never be its own partner, however fast it
sends. So the estimate counts only arrivals that overlap a pending request of the same group:

    rate = (arrivals, each counted once per request of the group still pending when it came)
           / (the time requests of the group spent pending, summed over requests)

For independent (Poisson) traffic at rate r this converges to r whatever the requests' latencies, and
for a sequential client it stays 0, because its next request comes after the answer. Bursts show up as
a high rate at once (many arrivals while the first is pending). Both sums decay with `half_life_s`,
so the estimate follows the traffic of the last minute or so; their ratio survives a quiet spell, so a
quiet tenant keeps being sent at once. A newcomer waits when `rate x window` (the expected partners within its window) reaches `min_partners`;
one that finds its group's window already open always joins it (that costs nothing).

A group with no history yet is judged by its family's (the tier's) new groups: the same rate, pooled over
the first request of every new group of the family while it is pending (arrivals of its group that overlap
it, over its pending time). Where new groups do find partners (a burst of a new question), a new group
waits and its first requests merge; where they do not (every request has its own system prompt: a session
id, the date, a user's profile), a new group is sent at once instead of paying a whole window each time.
Before the family has any evidence, a new group waits, as a fixed window would.

`WindowEstimator` is synchronous and takes the time as an argument: the queue calls `arrive` and
`depart` and acts on the answer.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Hashable
from dataclasses import dataclass

DEFAULT_HALF_LIFE_S = 30.0
DEFAULT_MIN_PARTNERS = 0.1  # about a 10% chance that a partner arrives within the window (Poisson)
DEFAULT_MAX_GROUPS = 4096


@dataclass(slots=True)
class _Overlap:
    """Decayed sums of one group: overlapping arrivals, pending exposure (seconds), pending count."""

    arrivals: float = 0.0
    exposure_s: float = 0.0
    pending: int = 0
    updated: float = 0.0
    seen: bool = False  # some pending time has been observed: the ratio means something
    family: Hashable = None
    first_pending: bool = False  # its first request is pending and counted in its family's new-group pool


def expected_partners(arrivals: float, exposure_s: float, window_s: float) -> float:
    """The partners a window of `window_s` may expect at rate `arrivals / exposure_s` (0 with no evidence)."""
    if arrivals <= 0:
        return 0.0
    if exposure_s <= 0:
        return math.inf  # arrivals at the very instant another was pending: a burst
    return arrivals / exposure_s * window_s


class WindowEstimator:
    """Per-group overlap rates and the wait-or-send decision (see the module docstring).

    At most `max_groups` groups are tracked; the least recently seen is forgotten first (its requests'
    later `depart` calls are then ignored).
    """

    def __init__(self, *, half_life_s: float = DEFAULT_HALF_LIFE_S, max_groups: int = DEFAULT_MAX_GROUPS) -> None:
        if half_life_s <= 0:
            raise ValueError("half_life_s must be positive")
        self._tau = half_life_s / math.log(2)
        self._max_groups = max_groups
        self._groups: collections.OrderedDict[Hashable, _Overlap] = collections.OrderedDict()
        self._new_groups: dict[Hashable, _Overlap] = {}  # family -> the pool of its new groups' first requests

    def arrive(self, group: Hashable, now: float, *, window_s: float, min_partners: float,
               family: Hashable = None) -> bool:
        """Record an arrival; True when it should wait `window_s` for partners, False to send it at once.

        `family` (a tier) pools the evidence of its new groups, which judges a group with no history."""
        state = self._state(group, now, family)
        if state.first_pending:  # an arrival overlapping a new group's first request: evidence for the family
            pool = self._pool(state.family, now)
            pool.arrivals += 1
        state.arrivals += state.pending  # every pending request of the group sees this arrival
        state.pending += 1
        if not state.seen and state.arrivals == 0:
            pool = self._pool(family, now)
            pool.pending += 1
            state.first_pending = True
            if not pool.seen and pool.arrivals == 0:
                return True  # no evidence anywhere yet: behave as a fixed window until there is some
            return expected_partners(pool.arrivals, pool.exposure_s, window_s) >= min_partners
        return expected_partners(state.arrivals, state.exposure_s, window_s) >= min_partners

    def would_wait(self, group: Hashable, now: float, *, window_s: float, min_partners: float,
                   family: Hashable = None) -> bool:
        """What `arrive` would answer for an arrival now, recording nothing (so a caller can ask first, then
        record the arrival where the request goes)."""
        state = self._groups.get(group)
        if state is None or (not state.seen and state.arrivals + state.pending == 0):
            pool = self._new_groups.get(family)
            if pool is None:
                return True
            self._advance(pool, now)  # only brings its sums to now: no event is recorded
            if not pool.seen and pool.arrivals == 0:
                return True
            return expected_partners(pool.arrivals, pool.exposure_s, window_s) >= min_partners
        self._advance(state, now)
        return expected_partners(state.arrivals + state.pending, state.exposure_s, window_s) >= min_partners

    def depart(self, group: Hashable, now: float) -> None:
        """A request of `group` got its answer (or left): it no longer watches for arrivals."""
        state = self._groups.get(group)
        if state is None or state.pending == 0:
            return
        self._advance(state, now)
        state.pending -= 1
        if state.pending == 0:
            self._end_first(state, now)

    def expected(self, group: Hashable, now: float, window_s: float) -> float:
        """The current expected partners of `group` within `window_s` (for stats and tests)."""
        state = self._groups.get(group)
        if state is None:
            return 0.0
        self._advance(state, now)
        return expected_partners(state.arrivals, state.exposure_s, window_s)

    def __len__(self) -> int:
        return len(self._groups)

    def _state(self, group: Hashable, now: float, family: Hashable) -> _Overlap:
        state = self._groups.get(group)
        if state is None:
            state = self._groups[group] = _Overlap(updated=now, family=family)
            if len(self._groups) > self._max_groups:
                _, forgotten = self._groups.popitem(last=False)
                self._end_first(forgotten, now)  # its departures will be ignored: leave the pool now
        else:
            self._groups.move_to_end(group)
            self._advance(state, now)
        return state

    def _pool(self, family: Hashable, now: float) -> _Overlap:
        pool = self._new_groups.get(family)
        if pool is None:
            pool = self._new_groups[family] = _Overlap(updated=now)
        self._advance(pool, now)
        return pool

    def _end_first(self, state: _Overlap, now: float) -> None:
        """The group's first request is no longer pending (the group has none): it leaves its family's pool."""
        if state.first_pending:
            state.first_pending = False
            self._pool(state.family, now).pending -= 1

    def _advance(self, state: _Overlap, now: float) -> None:
        """Decay both sums to `now` and add the exposure the pending requests gathered meanwhile."""
        elapsed = now - state.updated
        if elapsed <= 0:  # already brought to now (an arrival's pool, its group's first look): nothing to add
            return
        tau = self._tau
        decay = math.exp(-elapsed / tau)
        # The exact decayed integral of a constant pending count over the elapsed time.
        state.exposure_s = state.exposure_s * decay + state.pending * tau * (1.0 - decay)
        state.arrivals *= decay
        state.updated = now
        if state.pending:
            state.seen = True
