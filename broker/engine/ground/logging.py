"""Structured logging: JSON lines through structlog, one event per completed request.

Keys are stable (`request_id`, `tenant`, `tier`, `model`, `batch_id`...). Prompt text and API keys are
never logged: `redact_secrets` drops any key that looks like a secret as a last line of defence.
"""

from __future__ import annotations

import contextvars
import datetime
import logging
import sys
import time
import types
from collections.abc import Mapping, MutableMapping
from typing import Any

import orjson
import structlog

from mergebroker.clock import Clock, monotonic

_SECRET_KEYS = frozenset({"api_key", "authorization", "password", "secret", "gateway_secret", "prompt", "messages",
                          "content", "input", "text"})


_NOTHING_BOUND: Mapping[str, Any] = types.MappingProxyType({})
_LOG_CONTEXT: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar("mergebroker_log_context",
                                                                                   default=_NOTHING_BOUND)
"""The keys every event of the current task carries (`request_id`, `batch_id`...): one variable holding a
mapping that is replaced, never changed in place, so a task's copy of the context keeps its own."""


def bind_log_context(**values: Any) -> None:
    """Add `values` to every event logged from this task (and the tasks it starts) from now on.

    One context variable for all keys: structlog's own contextvars keep one variable per key, and its merge
    processor walks every variable of the context on every event (a visible share of the request line)."""
    _LOG_CONTEXT.set({**_LOG_CONTEXT.get(), **values})


def unbind_log_context(*keys: str) -> None:
    """Stop adding `keys` to this task's events."""
    bound = _LOG_CONTEXT.get()
    if any(key in bound for key in keys):
        _LOG_CONTEXT.set({k: v for k, v in bound.items() if k not in keys})


def clear_log_context() -> None:
    """Nothing bound for this task from now on (a task that must not carry its creator's keys)."""
    _LOG_CONTEXT.set(_NOTHING_BOUND)


def merge_log_context(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: the task's bound keys, where the event does not name them itself."""
    for key, value in _LOG_CONTEXT.get().items():
        event.setdefault(key, value)
    return event


_NOT_SECRET: set[Any] = set()
"""Keys seen and found not secret-looking: event keys are names in the code, so they are few, and an event's
keys not among them are found by one set difference in C rather than a check per key in Python."""


def redact_secrets(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: replace values of secret-looking keys."""
    for key in event.keys() - _NOT_SECRET:
        if str(key).lower() in _SECRET_KEYS:
            event[key] = "[redacted]"  # a value replaced, no key added: the keys iterated are a set apart
        elif len(_NOT_SECRET) < 10_000:  # a key made of data (a dict splatted into an event) stays bounded
            _NOT_SECRET.add(key)
    return event


class UtcStamp:
    """structlog processor: the level and an ISO-8601 UTC timestamp with microseconds, the date and time to
    the second formatted once per second (structlog's `TimeStamper` formats the whole stamp every line)."""

    def __init__(self) -> None:
        self._second = -1
        self._prefix = ""

    def __call__(self, _logger: Any, name: str, event: dict[str, Any]) -> dict[str, Any]:
        now = time.time()
        second = int(now)
        if second != self._second:
            self._second = second
            self._prefix = datetime.datetime.fromtimestamp(second, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S")
        event["level"] = name
        event["timestamp"] = f"{self._prefix}.{int((now - second) * 1_000_000):06d}Z"
        return event


class RequestLogSampler:
    """Which requests get a `request` line: every error, and successful ones up to `per_s` a second (a token
    bucket holding one second's worth); the skipped ones are counted in one `request_log_sampled` line at most
    once a second. `per_s` None logs every request. At thousands of requests a second the line is a visible
    share of the broker's CPU (8 us of roughly 500, written by `log_info_event`), and a log that size is read
    by sampling anyway."""

    def __init__(self, per_s: float | None, *, clock: Clock = monotonic) -> None:
        self._clock = clock
        self.limit(per_s)

    def limit(self, per_s: float | None) -> None:
        """Write at most `per_s` successful requests' lines a second from now on (None: all of them)."""
        self._per_s = per_s
        self._tokens = per_s or 0.0
        self._at = self._clock()
        self._skipped = 0
        self._report_at = self._at + 1.0

    def admit(self, error: bool) -> bool:
        """Whether this request's line is written; `error`: it failed (always written)."""
        if self._per_s is None:
            return True
        now = self._clock()
        self._tokens = min(self._per_s, self._tokens + (now - self._at) * self._per_s)
        self._at = now
        if self._skipped and now >= self._report_at:
            structlog.get_logger("mergebroker.access").info("request_log_sampled", skipped=self._skipped,
                                                            lines_per_s=self._per_s)
            self._skipped, self._report_at = 0, now + 1.0
        if error:
            return True
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        self._skipped += 1
        return False


REQUEST_LOG = RequestLogSampler(None)
"""This process's request-line sampler (every line until `configure_logging` says otherwise)."""


class _JsonLines:
    """The JSON-lines pipeline `configure_logging` installed: its level, time stamp, renderer (by identity, to
    tell the pipeline from one installed over it, such as a test's `capture_logs`) and file, for
    `log_info_event` to write a line the way that pipeline would."""

    def __init__(self, level: int, stamp: UtcStamp, render: Any, file: Any) -> None:
        self.level, self.stamp, self.render = level, stamp, render
        self.logger = structlog.BytesLogger(file)  # shares structlog's per-file lock: lines never interleave


_JSON_LINES: _JsonLines | None = None


def log_info_event(logger: Any, event: str, fields: dict[str, Any]) -> None:
    """Log `event` with `fields` at info, as `logger.info(event, **fields)` would (`fields` is consumed).

    The request line is written once per request: through structlog's bound logger and processor chain it
    cost 21 us (its fields built, the line written to /dev/null), rendered here 8 us. The line is the same
    bytes: the event's fields, then `event`, the task's bound keys, level and timestamp, secrets redacted,
    rendered by the pipeline's own renderer. Under any other pipeline (console rendering, a test capturing
    events) it goes through structlog."""
    lines = _JSON_LINES
    # `capture_logs` swaps the list's contents in place: the renderer at its end says whose pipeline it is.
    if lines is None or structlog.get_config()["processors"][-1:] != [lines.render]:
        logger.info(event, **fields)
        return
    if lines.level > logging.INFO:
        return
    fields["event"] = event
    for key, value in _LOG_CONTEXT.get().items():
        fields.setdefault(key, value)
    lines.logger.msg(lines.render(None, "info", redact_secrets(None, "info", lines.stamp(None, "info", fields))))


def configure_logging(level: str = "info", *, json_lines: bool = True, request_lines_per_s: float | None = None) -> None:
    """Configure structlog once for the process (JSON lines on stderr, or console rendering), and how many
    `request` lines a second it writes (`RequestLogSampler`)."""
    REQUEST_LOG.limit(request_lines_per_s)
    # JSON lines are rendered by orjson straight to bytes: the request log is written once per request, and
    # the standard library's encoder plus a text stream cost it 22 us a line where this costs 12 us.
    global _JSON_LINES
    threshold = getattr(logging, level.upper())
    if json_lines:
        utc_stamp = UtcStamp()
        stamp: list[Any] = [utc_stamp]
        renderer: Any = structlog.processors.JSONRenderer(serializer=orjson.dumps)
        factory: Any = structlog.BytesLoggerFactory(file=sys.stderr.buffer)
        _JSON_LINES = _JsonLines(threshold, utc_stamp, renderer, sys.stderr.buffer)
    else:
        stamp = [structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso", utc=True)]
        renderer, factory = structlog.dev.ConsoleRenderer(), structlog.PrintLoggerFactory(file=sys.stderr)
        _JSON_LINES = None
    structlog.configure(
        processors=[merge_log_context, *stamp, redact_secrets, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(threshold),
        logger_factory=factory,
        # Each module's logger is a lazy proxy that would build a new logger on every call (2 us a request
        # event) unless cached. Only serving processes configure logging, and they log nothing before this
        # point; tests that capture logs run on structlog's defaults, where nothing is cached.
        cache_logger_on_first_use=True,
    )
