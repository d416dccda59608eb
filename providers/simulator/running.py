"""A simulator serving on a loopback port, as tests and benchmarks hold it: its URL, counters, bill and faults."""

from __future__ import annotations

from typing import Any, Protocol

from aiohttp import web

from mergebroker.providers.simulator.billing import Biller
from mergebroker.providers.simulator.faults import SimulatorConfig


class Simulator(Protocol):
    """What a running simulator is read through: the server's Simulator, named by shape so this module sits below
    the server that builds it (an import back would be a cycle)."""

    biller: Biller
    last_request_body: dict[str, Any] | None
    last_request: dict[str, Any] | None

    @property
    def config(self) -> SimulatorConfig: ...

    def stats_dict(self) -> dict[str, Any]: ...

    def set_faults(self, **fields: Any) -> dict[str, Any]: ...

    def reset_stats(self, *, keep_cache: bool = False) -> None: ...

    def close(self) -> None: ...


class RunningSimulator:
    """A simulator serving on a loopback port; direct access to its counters and faults (no HTTP)."""

    def __init__(self, runner: web.AppRunner, simulator: Simulator, host: str, port: int) -> None:
        self._runner = runner
        self._simulator = simulator
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        """The OpenAI base URL, e.g. "http://127.0.0.1:PORT/v1"."""
        return f"http://{self.host}:{self.port}/v1"

    @property
    def config(self) -> SimulatorConfig:
        """The current configuration."""
        return self._simulator.config

    def stats(self) -> dict[str, Any]:
        """The counters and the bill, as GET /stats shows them."""
        return self._simulator.stats_dict()

    def bill(self) -> dict[str, Any]:
        """The bill, as GET /_sim/bill shows it."""
        return self._simulator.biller.as_dict(self._simulator.config)

    def reset_bill(self, *, keep_cache: bool = False) -> None:
        """Zero the bill and forget the prompt cache unless `keep_cache` (the other counters stay)."""
        self._simulator.biller.reset(keep_cache=keep_cache)

    def set_faults(self, **fields: Any) -> dict[str, Any]:
        """Change run-time fields now (faults, latency, billing, streaming; ValueError for bad ones); returns them all."""
        return self._simulator.set_faults(**fields)

    def last_request_body(self) -> dict[str, Any] | None:
        """The JSON body of the last chat, embeddings, Responses or Messages call received (to check what a broker
        forwarded)."""
        return self._simulator.last_request_body

    def last_request(self) -> dict[str, Any] | None:
        """The last such call's method, path, query, headers and body, as GET /_sim/last_request shows it."""
        return self._simulator.last_request

    def reset_stats(self, *, keep_cache: bool = False) -> None:
        """Zero every counter and the bill; forget the prompt cache unless `keep_cache`."""
        self._simulator.reset_stats(keep_cache=keep_cache)

    async def close(self) -> None:
        """Stop serving; hanging calls end at once."""
        self._simulator.close()
        await self._runner.cleanup()

    async def __aenter__(self) -> RunningSimulator:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
