"""Cluster mode's pure rules: who may claim which entry, when a silent worker counts as dead, which jobs
the fence drops, where a late job's window starts, which awaited jobs a front-end serves itself when it
loses Redis, and one warning per outage."""

from __future__ import annotations

from redis.exceptions import ConnectionError, ResponseError
from structlog.testing import capture_logs

from mergebroker.broker.cluster.claims import Claim, Pending, plan_claims
from mergebroker.broker.cluster.holds import Flight, Held, fence_drops, next_fence
from mergebroker.broker.cluster.inflight import InFlight
from mergebroker.broker.cluster.outage import Outage
from mergebroker.broker.cluster.presence import DeathWatch
from mergebroker.broker.cluster.server_time import late_grace, window_anchor
from mergebroker.broker.cluster.wire import WireReply, decode_reply, encode_reply

IDLE = 5000


def test_a_dead_owners_entries_are_claimed_at_once_and_a_silent_ones_only_unsent_after_claim_idle():
    pending = [Pending(b"1-0", "dead", 10), Pending(b"2-0", "paused", IDLE), Pending(b"3-0", "busy", 100),
               Pending(b"4-0", "me", IDLE), Pending(b"5-0", "me", IDLE)]
    plan = plan_claims(pending, me="me", held={b"4-0"}, dead={"dead"}, claim_idle_ms=IDLE, room=10)
    assert plan == [Claim(b"1-0", "dead", 0, unless_sent=False),  # its answer can never come
                    Claim(b"2-0", "paused", IDLE, unless_sent=True),  # unless it went upstream before the pause
                    Claim(b"5-0", "me", IDLE, unless_sent=True)]  # dropped at this worker's own fence
    assert len(plan_claims(pending, me="me", held=set(), dead={"dead"}, claim_idle_ms=IDLE, room=2)) == 2


def test_a_worker_is_dead_only_once_its_connection_stayed_gone_for_the_confirmation_time():
    watch = DeathWatch(confirm_s=0.5)
    assert watch.observe({"w1"}, 10.0) == set()
    assert watch.observe(set(), 10.25) == set()  # it reconnected and registered again: alive
    assert watch.observe({"w1"}, 10.5) == set() and watch.observe({"w1"}, 10.75) == set()
    assert watch.observe({"w1"}, 11.0) == {"w1"}  # reported once
    assert watch.observe(set(), 11.25) == set()


def _held(touched_at: float, sent: bool = False) -> Held:
    held = Held("s", b"1-0", None, touched_at=touched_at)  # type: ignore[arg-type]
    flight = Flight(job=type("J", (), {"dispatched": sent})(), entries=[held])  # type: ignore[arg-type]
    held.flight = flight
    return held


def test_the_fence_drops_only_unsent_jobs_untouched_for_the_fence_time():
    fresh, stale, sent = _held(9.0), _held(6.0), _held(6.0, sent=True)
    assert fence_drops([fresh, stale, sent], now=10.0, fence_s=3.0) == [stale]
    assert next_fence([fresh, stale, sent], fence_s=3.0) == 9.0
    assert next_fence([sent], fence_s=3.0) is None


def test_a_jobs_window_counts_from_its_front_end_unless_that_leaves_less_than_the_late_grace():
    assert late_grace(0.25) == 0.05 and late_grace(0.01) == 0.005
    assert window_anchor(now=100.0, queued=99.9, window_s=0.25) == 99.9  # the hop costs the window nothing
    assert window_anchor(now=100.0, queued=97.0, window_s=0.25) == 100.0 - 0.25 + 0.05  # a backlog: 50 ms more
    assert window_anchor(now=100.0, queued=100.2, window_s=0.25) == 100.0  # clock skew: never in the future


async def test_losing_redis_a_front_end_serves_what_a_dead_worker_sent_and_holds_the_rest_for_a_hand_over():
    from mergebroker.broker.engine.chat.jobs import ChatJob
    from mergebroker.broker.engine.limits.admission import Caller

    def job(name: str, deadline: float = 1e9) -> ChatJob:
        return ChatJob(request_id=name, caller=Caller("t", "batch"), body={}, model="m", priority=0.0, shape=None,
                       merge_key=None, prompt_tokens=1, max_tokens=1, deadline=deadline, enqueued_at=0.0)

    inflight = InFlight()
    for cid, deadline in (("unsent", 1e9), ("unsent-due-soon", 10.0), ("sent-by-live", 1e9), ("sent-by-dead", 1e9)):
        inflight.add(cid, job(cid, deadline), 0.0)
        inflight.entry_added(cid, ("stream", cid))
    inflight.note("sent-by-live", "w1")
    inflight.note("sent-by-dead", "w2")
    jobs, entries = inflight.release_noted_by({"w2"})
    assert [j.request_id for j in jobs] == ["sent-by-dead"] and entries == [("stream", "sent-by-dead")]
    inflight.hold_unnoted(now=0.0, wait_s=15.0)
    assert inflight.held() == ["unsent", "unsent-due-soon"]  # a worker may still note them: not served yet
    assert inflight.release_overdue(4.9) == ([], [])
    jobs, entries = inflight.release_overdue(5.0)  # half its remaining time: the local queue has the other half
    assert [j.request_id for j in jobs] == ["unsent-due-soon"] and entries == [("stream", "unsent-due-soon")]
    assert inflight.entries_of(inflight.held()) == [("stream", "unsent")]
    assert [j.request_id for j in inflight.release_unnoted(["unsent", "sent-by-live"])] == ["unsent"]
    assert inflight.cids() == ["sent-by-live"] and inflight.senders() == {"w1"}


def test_a_sent_note_round_trips():
    back = decode_reply(encode_reply(WireReply("c", sent_by="host-1-abc")))
    assert (back.correlation_id, back.sent_by, back.outcome, back.error) == ("c", "host-1-abc", None, None)


def test_an_outage_is_one_warning_however_many_loops_hit_it_and_one_line_when_it_ends():
    started = []
    outage = Outage("worker", on_start=lambda: started.append(True))
    with capture_logs() as logs:
        for loop in ("read", "write", "heartbeat", "read"):
            outage.failed(loop, ConnectionError("refused"))
        outage.ok()
        outage.ok()
        outage.failed("claim", ResponseError("a script error is no outage"))
    levels = [(e["log_level"], e["event"]) for e in logs]
    assert levels.count(("warning", "cluster_redis_unreachable")) == 1 and started == [True]
    assert levels.count(("info", "cluster_redis_recovered")) == 1
    assert ("warning", "cluster_redis_error") in levels and not outage.down
