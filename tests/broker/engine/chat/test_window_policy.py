"""The adaptive window waits only where partners arrive: never for a sequential client, always under load."""

from __future__ import annotations

import random

import pytest

from mergebroker.merge.window_policy import WindowEstimator, expected_partners

WINDOW_S = 0.05


def test_a_sequential_client_waits_once_then_never_however_fast_it_sends():
    estimator = WindowEstimator()
    now, waits = 0.0, []
    for _ in range(200):
        waits.append(estimator.arrive("g", now, window_s=WINDOW_S, min_partners=0.1))
        now += 0.001  # answered a millisecond later ...
        estimator.depart("g", now)
        now += 0.0001  # ... and the next request follows at once
    assert waits[0] and not any(waits[1:])
    assert not estimator.arrive("g", now + 3600, window_s=WINDOW_S, min_partners=0.1)  # still quiet an hour on


def test_independent_traffic_is_estimated_at_its_rate_and_waits():
    rng = random.Random(3)
    estimator = WindowEstimator(half_life_s=30.0)
    now, rate, pending = 0.0, 40.0, []
    for _ in range(4000):
        now += rng.expovariate(rate)
        while pending and pending[0] <= now:
            estimator.depart("g", pending.pop(0))
        estimator.arrive("g", now, window_s=WINDOW_S, min_partners=0.1)
        pending.append(now + rng.uniform(0.05, 0.6))  # latencies vary; the estimate does not depend on them
        pending.sort()
    assert estimator.expected("g", now, 1.0) == pytest.approx(rate, rel=0.25)
    assert estimator.arrive("g", now, window_s=WINDOW_S, min_partners=0.1)


def test_a_burst_waits_from_its_second_request_on():
    estimator = WindowEstimator()
    waits = [estimator.arrive("g", 5.0, window_s=WINDOW_S, min_partners=0.1) for _ in range(4)]
    assert waits == [True, True, True, True]  # the first: no history yet; the others: a partner is pending
    for _ in range(4):
        estimator.depart("g", 5.1)
    assert estimator.arrive("g", 9.0, window_s=WINDOW_S, min_partners=0.1)  # the next burst's first waits too


def test_groups_are_estimated_apart():
    estimator = WindowEstimator()
    for _ in range(5):
        estimator.arrive("busy", 1.0, window_s=WINDOW_S, min_partners=0.1)
    estimator.arrive("quiet", 1.0, window_s=WINDOW_S, min_partners=0.1)
    estimator.depart("quiet", 1.2)
    assert estimator.arrive("busy", 1.3, window_s=WINDOW_S, min_partners=0.1)
    assert not estimator.arrive("quiet", 1.3, window_s=WINDOW_S, min_partners=0.1)


def test_only_the_most_recent_groups_are_kept_and_unknown_departures_are_ignored():
    estimator = WindowEstimator(max_groups=3)
    for n in range(10):
        estimator.arrive(n, float(n), window_s=WINDOW_S, min_partners=0.1)
    assert len(estimator) == 3
    estimator.depart(0, 20.0)  # forgotten: nothing to do


@pytest.mark.parametrize("arrivals, exposure, expected", [(0, 0, 0.0), (0, 5, 0.0), (2, 1, 2 * WINDOW_S)])
def test_expected_partners(arrivals, exposure, expected):
    assert expected_partners(arrivals, exposure, WINDOW_S) == pytest.approx(expected)


def test_half_life_must_be_positive():
    with pytest.raises(ValueError):
        WindowEstimator(half_life_s=0)


def test_new_groups_that_never_find_a_partner_stop_paying_a_window_each():
    """Each request its own group (its own system prompt): only the family's first new group waits."""
    estimator = WindowEstimator()
    now, waits = 0.0, []
    for i in range(50):
        waits.append(estimator.arrive(("std", f"key {i}"), now, window_s=WINDOW_S, min_partners=0.1, family="std"))
        now += WINDOW_S if waits[-1] else 0.002  # a waiting one is pending for its window, then answered
        estimator.depart(("std", f"key {i}"), now)
        now += 0.001
    assert waits[0] and not any(waits[1:])
    # Another family has no evidence of its own yet: its first new group waits as before.
    assert estimator.arrive(("batch", "key 0"), now, window_s=WINDOW_S, min_partners=0.1, family="batch")


def test_new_groups_still_wait_where_new_groups_find_partners():
    """A family whose new questions come in bursts keeps waiting for a new group's partners."""
    estimator = WindowEstimator()
    now, firsts = 0.0, []
    for i in range(30):
        group = ("std", f"hot question {i}")
        firsts.append(estimator.arrive(group, now, window_s=WINDOW_S, min_partners=0.1, family="std"))
        for _ in range(3):  # its partners come within 5 ms of it, while it is pending
            now += 0.005
            assert estimator.arrive(group, now, window_s=WINDOW_S, min_partners=0.1, family="std")
        now += WINDOW_S
        for _ in range(4):
            estimator.depart(group, now)
        now += 0.2
    assert all(firsts)

