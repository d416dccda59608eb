"""Cluster mode's pure parts: the wire format round-trips, partitions are stable, leases split fairly."""

from __future__ import annotations

import pytest

from mergebroker.broker.cluster.partition import Keys, fair_share, flight_key, lease_plan, partition_of, preferred_order
from mergebroker.broker.cluster.wire import WireJob, WireReply, decode_job, decode_reply, encode_job, encode_reply
from mergebroker.broker.engine.chat.jobs import ChatOutcome
from mergebroker.broker.engine.limits.admission import Caller
from mergebroker.errors import BrokerError, DeadlineExceeded, UpstreamError, UpstreamUnavailable
from mergebroker.token_usage import TokenUsage

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi </request> <response id=\"x\">"}]}


def test_job_round_trips_with_caller_deadline_and_keys():
    job = WireJob("cid1", "mb:replies:f1", "req-1", Caller("acme", "batch", key_id="k1", user="u:1"), BODY, "mk", "fk",
                  12, 34, 1_700_000_000_123, enqueued_ms=1_700_000_000_100)
    assert decode_job(encode_job(job)) == job


def test_a_job_from_a_front_end_without_an_enqueue_time_still_reads():
    job = WireJob("cid1", "to", "req-1", Caller("acme", "batch"), BODY, None, "fk", 1, 2, 3)
    fields = encode_job(job)
    fields[b"j"] = fields[b"j"].replace(b',"at":0', b"")
    assert decode_job(fields).enqueued_ms == 0


@pytest.mark.parametrize("error", [DeadlineExceeded("late"), UpstreamUnavailable(3.0),
                                   UpstreamError("bad gateway", status=502),
                                   BrokerError("full", status=503, code="queue_full", retry_after=1)])
def test_errors_come_back_with_their_status_code_and_class(error):
    back = decode_reply(encode_reply(WireReply("c", error=error))).error
    assert (back.status, back.type, back.code, back.message, back.retry_after) == (
        error.status, error.type, error.code, error.message, error.retry_after)
    if isinstance(error, (DeadlineExceeded, UpstreamUnavailable)):
        assert type(back) is type(error)  # the front-end's code tells these apart


def test_outcome_round_trips():
    outcome = ChatOutcome({"choices": []}, "sim", 0.25, 3, "b_1", None)
    assert decode_reply(encode_reply(WireReply("c", outcome=outcome))).outcome == outcome


def test_an_early_released_outcome_says_its_usage_follows_and_the_usage_message_round_trips():
    outcome = ChatOutcome({"choices": []}, "sim", 0.25, 3, "b_1", None)
    back = decode_reply(encode_reply(WireReply("c", outcome=outcome, settles=True)))
    assert back.settles and back.outcome == outcome
    usage = TokenUsage(40, 12, cached_tokens=30, cache_write_tokens=4, counted=True)
    later = decode_reply(encode_reply(WireReply("c", settled=usage)))
    assert (later.correlation_id, later.settled, later.outcome) == ("c", usage, None)


@pytest.mark.parametrize("fields", [{}, {b"j": b"not json"}, {b"j": b'{"v": 99}'}, {b"j": b'{"v": 1}'}])
def test_unreadable_entries_raise_value_error(fields):
    with pytest.raises(ValueError):
        decode_job(fields)
    with pytest.raises(ValueError):
        decode_reply(fields)


def test_partition_is_stable_and_spread():
    assert partition_of("abc", 64) == partition_of("abc", 64)
    assert len({partition_of(f"key{i}", 64) for i in range(1000)}) == 64


def test_flight_key_separates_tenants_tiers_and_merge_opt_out():
    keys = {flight_key("a", "batch", True, BODY), flight_key("b", "batch", True, BODY),
            flight_key("a", "standard", True, BODY), flight_key("a", "batch", False, BODY)}
    assert len(keys) == 4
    assert flight_key("a", "batch", True, dict(reversed(list(BODY.items())))) == flight_key("a", "batch", True, BODY)


def test_fair_share_rounds_up_so_no_partition_is_left_over():
    assert [fair_share(64, n) for n in (0, 1, 2, 3, 64, 100)] == [64, 64, 32, 22, 1, 1]


def test_lease_plan_takes_up_to_share_and_gives_up_the_latest_in_its_order():
    order = preferred_order("w1", 8)
    assert sorted(order) == list(range(8))
    acquire, release = lease_plan(set(order[:2]), 4, order)
    assert acquire == order[2:] and release == []
    acquire, release = lease_plan(set(order), 3, order)
    assert acquire == [] and release == order[3:]


def test_keys_live_under_one_prefix():
    keys = Keys("mb:c")
    assert {keys.jobs("batch", 3), keys.lease(3), keys.replies("f"), keys.workers} == {
        "{mb:c}:jobs:batch:3", "{mb:c}:lease:3", "{mb:c}:replies:f", "{mb:c}:workers"}  # one slot in a Redis Cluster


def test_orphan_scans_run_after_a_change_of_hands_and_rarely_otherwise():
    from mergebroker.broker.cluster.worker import SAFETY_SCAN_EVERY, claim_due

    idle = 1.0
    assert claim_due(now=101.5, orphans_at=100.0, last_scan_at=101.2, claim_idle_s=idle)  # partition just acquired
    assert not claim_due(now=103.0, orphans_at=100.0, last_scan_at=102.9, claim_idle_s=idle)  # quiet: no scan
    assert claim_due(now=103.0 + SAFETY_SCAN_EVERY, orphans_at=100.0, last_scan_at=103.0, claim_idle_s=idle)


class _Time:
    """A Redis `TIME` whose answers arrive after the given local delays (the server's clock reads 1,000 s ahead)."""

    def __init__(self, clock, delays_s):
        self._clock, self._delays = clock, list(delays_s)

    async def time(self):
        half = self._delays.pop(0) / 2
        self._clock.advance(half)
        server_s = self._clock() + 1000.0
        self._clock.advance(half)
        return int(server_s), int(round((server_s % 1) * 1e6))


async def test_the_server_clock_keeps_the_offset_of_its_fastest_round_trip():
    from mergebroker.broker.cluster.server_time import ServerClock
    from mergebroker.clock import FakeClock

    clock = FakeClock()
    server = ServerClock(clock)
    # A slow sample whose reply waited at the end of its round trip: taken alone it would be 10 ms off.
    asymmetric = _Time(clock, [0.001, 0.001, 0.001])
    await server.sync(asymmetric)
    assert abs(server.now_ms() - (clock() + 1000.0) * 1000) < 1.0
    late = _Time(clock, [0.0])
    late.time = _late_reply(clock)
    await server.sync(late)
    assert abs(server.now_ms() - (clock() + 1000.0) * 1000) < 1.0  # the slow sample did not move it


def _late_reply(clock):
    async def time():
        server_s = clock() + 1000.0
        clock.advance(0.020)  # the reply sat 20 ms in a busy host's queues
        return int(server_s), int(round((server_s % 1) * 1e6))
    return time
