"""The typed `web.AppKey`s the HTTP handlers read the application's state by.

A leaf of `http` (as in aiohttp's background-tasks example): `app`, `routes` and `middleware` all import
the keys from here, so none of them imports another to find its state.
"""

from __future__ import annotations

from aiohttp import web

from mergebroker.broker.bulk.batches import BatchService
from mergebroker.broker.engine.container import Engine
from mergebroker.broker.engine.wiring.reload import Reloader

BROKER = web.AppKey("broker", Engine)
BATCHES = web.AppKey("batches", BatchService)
"""The Batch API's service; absent when `batches.enabled` is off."""
RELOADER = web.AppKey("reloader", Reloader)
"""Re-reads the config and swaps the engine (SIGHUP, POST /v1/broker/reload); absent without a config source."""
SETTINGS_MAX_BODY = web.AppKey("max_body_bytes", int)
"""Set before the broker is built, so a body over the limit is refused even during start-up."""
