"""mergebroker service: HTTP API, admission, queues, workers, settings, logging, CLI.

`from mergebroker.broker import Broker` is the in-process library API (`mergebroker.broker.library`),
loaded on first use so that importing a single module of the service does not build the whole engine.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Broker"]


def __getattr__(name: str) -> Any:
    if name == "Broker":
        from mergebroker.broker.library import Broker

        return Broker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
