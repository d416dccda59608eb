"""Structured logging: JSON lines through structlog, one event per completed request.

Keys are stable (`request_id`, `tenant`, `tier`, `model`, `batch_id`...). Prompt text and API keys are
never logged: `redact_secrets` drops any key that looks like a secret as a last line of defence.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_SECRET_KEYS = frozenset({"api_key", "authorization", "password", "secret", "gateway_secret", "prompt", "messages",
                          "content", "input", "text"})


def redact_secrets(_logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
    """structlog processor: replace values of secret-looking keys."""
    for key in list(event):
        if key.lower() in _SECRET_KEYS:
            event[key] = "[redacted]"
    return event


def configure_logging(level: str = "info", *, json_lines: bool = True) -> None:
    """Configure structlog once for the process (JSON lines on stderr, or console rendering)."""
    renderer: Any = structlog.processors.JSONRenderer() if json_lines else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            redact_secrets,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        # Each module's logger is a lazy proxy that would build a new logger on every call (2 us a request
        # event) unless cached. Only serving processes configure logging, and they log nothing before this
        # point; tests that capture logs run on structlog's defaults, where nothing is cached.
        cache_logger_on_first_use=True,
    )
