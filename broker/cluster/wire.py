"""The job and reply formats on the streams: what a worker needs, and what a front-end hands its caller.

Pure: `encode_job`/`decode_job` and `encode_reply`/`decode_reply` turn dataclasses into stream-entry
fields and back. Deadlines travel as absolute Redis server time in milliseconds (one clock for the
cluster, see `server_time`). Errors travel as their OpenAI envelope parts and come back as the same
`BrokerError` class when the front-end's code has to tell it apart (a deadline, a refusal), otherwise
as a `BrokerError` with the same status, type, code and message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mergebroker.broker.engine.chat.jobs import ChatOutcome
from mergebroker.broker.engine.limits.admission import Caller
from mergebroker.errors import BrokerError, DeadlineExceeded, NotFound, Overloaded, UpstreamError, UpstreamUnavailable
from mergebroker.token_usage import NO_USAGE, TokenUsage

WIRE_VERSION = 1
FIELD = b"j"  # every entry carries one JSON document under this field


@dataclass(frozen=True)
class WireJob:
    """One chat job on a partition stream."""

    correlation_id: str
    reply_to: str  # the front-end's reply stream
    request_id: str
    caller: Caller
    body: dict[str, Any]
    merge_key: str | None
    flight_key: str  # identical requests share it: the worker coalesces them
    prompt_tokens: int
    max_tokens: int
    deadline_ms: int  # Redis server time
    enqueued_ms: int = 0  # when the front-end queued it, Redis server time (0: unknown, count from the read)
    traceparent: str | None = None  # W3C traceparent of its request's span (tracing on), for the worker's call


@dataclass(frozen=True)
class WireReply:
    """A worker's answer for one correlation ID: an outcome or an error; or a message of its own, either
    the note that the job went upstream (`sent_by`, the worker's ID: no one may run it again while that
    worker lives) or the usage the provider reported for an outcome released early (`settled`)."""

    correlation_id: str
    outcome: ChatOutcome | None = None
    error: BrokerError | None = None
    worker_s: float = 0.0  # from the worker's read to its reply: the rest of the round trip is the hop
    settles: bool = False  # the outcome was released early: a `settled` message for it follows
    settled: TokenUsage | None = None
    sent_by: str | None = None


def encode_job(job: WireJob) -> dict[bytes, bytes]:
    """Stream-entry fields for `job`."""
    c = job.caller
    doc = {"v": WIRE_VERSION, "cid": job.correlation_id, "to": job.reply_to, "rid": job.request_id,
           "caller": [c.tenant, c.tier, c.key_id, c.user], "body": job.body, "mk": job.merge_key,
           "fk": job.flight_key, "pt": job.prompt_tokens, "mt": job.max_tokens, "dl": job.deadline_ms,
           "at": job.enqueued_ms}
    if job.traceparent:
        doc["tp"] = job.traceparent
    return {FIELD: json.dumps(doc, separators=(",", ":")).encode()}


def decode_job(fields: dict[bytes, bytes]) -> WireJob:
    """The job in a stream entry; raises `ValueError` on an entry this version cannot read."""
    doc = _document(fields)
    try:
        tenant, tier, key_id, user = doc["caller"]
        return WireJob(correlation_id=str(doc["cid"]), reply_to=str(doc["to"]), request_id=str(doc["rid"]),
                       caller=Caller(tenant=tenant, tier=tier, key_id=key_id, user=user), body=doc["body"],
                       merge_key=doc["mk"], flight_key=str(doc["fk"]), prompt_tokens=int(doc["pt"]),
                       max_tokens=int(doc["mt"]), deadline_ms=int(doc["dl"]),
                       enqueued_ms=int(doc.get("at", 0)),
                       traceparent=doc["tp"] if isinstance(doc.get("tp"), str) else None)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"unreadable job entry: {type(exc).__name__}") from exc


def encode_reply(reply: WireReply) -> dict[bytes, bytes]:
    """Stream-entry fields for `reply`."""
    doc: dict[str, Any] = {"v": WIRE_VERSION, "cid": reply.correlation_id, "ws": round(reply.worker_s, 6)}
    if reply.sent_by is not None:
        doc["sent"] = reply.sent_by
    elif reply.settled is not None:
        doc["settled"] = reply.settled.as_fields()
    elif reply.outcome is not None:
        o = reply.outcome
        doc["ok"] = [o.body, o.provider, o.upstream_s, o.batch_size, o.batch_id, o.fallback]
        if reply.settles:
            doc["settles"] = True
    else:
        e = reply.error or BrokerError("The worker gave no answer.")
        doc["err"] = [type(e).__name__, e.status, e.type, e.code, e.message, e.param, e.retry_after]
    return {FIELD: json.dumps(doc, separators=(",", ":")).encode()}


def decode_reply(fields: dict[bytes, bytes]) -> WireReply:
    """The reply in a stream entry; raises `ValueError` on an entry this version cannot read."""
    doc = _document(fields)
    try:
        cid = str(doc["cid"])
        if "sent" in doc:
            return WireReply(cid, sent_by=str(doc["sent"]))
        if "settled" in doc:
            return WireReply(cid, settled=TokenUsage.from_fields(doc["settled"]) or NO_USAGE)
        if "ok" in doc:
            body, provider, upstream_s, batch_size, batch_id, fallback = doc["ok"]
            return WireReply(cid, outcome=ChatOutcome(body, provider, float(upstream_s), int(batch_size),
                                                      batch_id, fallback), worker_s=float(doc.get("ws", 0.0)),
                             settles=bool(doc.get("settles", False)))
        return WireReply(cid, error=_error(*doc["err"]), worker_s=float(doc.get("ws", 0.0)))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"unreadable reply entry: {type(exc).__name__}") from exc


def stream_pairs(response: Any) -> list[tuple[str, Any]]:
    """An `XREAD`/`XREADGROUP` answer (a list of pairs in RESP2, a mapping in RESP3) as (stream name, entries)."""
    if not response:
        return []
    pairs = response.items() if isinstance(response, dict) else response
    return [(s.decode() if isinstance(s, bytes) else s, entries) for s, entries in pairs]


def next_stream_id(entry_id: Any) -> str:
    """The smallest stream ID after `entry_id` (XTRIM MINID keeps IDs at or above it)."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
    ms, seq = text.split("-")
    return f"{ms}-{int(seq) + 1}"


# The classes the front-end's own code tells apart (ChatService retries a shared job cut by its deadline).
_KNOWN: dict[str, type[BrokerError]] = {"DeadlineExceeded": DeadlineExceeded, "Overloaded": Overloaded,
                                        "NotFound": NotFound}


def _error(name: str, status: int, type_: str, code: str | None, message: str, param: str | None,
           retry_after: float | None) -> BrokerError:
    if name == "UpstreamUnavailable":
        return UpstreamUnavailable(retry_after or 1.0, message)
    cls = _KNOWN.get(name, UpstreamError if name.startswith("Upstream") else BrokerError)
    error = cls(message, param=param, code=code, status=int(status), retry_after=retry_after)
    error.type = type_
    return error


def _document(fields: dict[bytes, bytes]) -> dict[str, Any]:
    raw = fields.get(FIELD)
    if raw is None:
        raise ValueError("entry without a job document")
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise ValueError("entry is not JSON") from exc
    if not isinstance(doc, dict) or doc.get("v") != WIRE_VERSION:
        raise ValueError(f"unknown wire version {doc.get('v') if isinstance(doc, dict) else None!r}")
    return doc
