"""mergebroker service. Its rooms, each importing only those below it:

    cli.py                     the `mergebroker` command
    http/ mcp/ eval/ warm_cache.py   the ways in (HTTP, agents, evaluation, cache warming)
    library.py                 the in-process API (`Broker`), which MCP builds on
    cluster/  bulk/            cluster mode on Redis Streams; the Batch API
    engine/                    what every way in shares, built by `engine.wiring.assemble`

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
