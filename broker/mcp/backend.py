"""Where the MCP server's tools send their calls: the broker in-process, or a running broker over HTTP.

    ToolBackend               the seam: chat / embeddings / stats, each answer a `Reply` or a `BrokerError`
    ├── EmbeddedBackend       the library API (`mergebroker.broker.library.Broker`) in this process
    └── RemoteBackend         a running broker's HTTP API (`mergebroker mcp --broker URL`)

Both authenticate the same way: the API key from the environment (read by the command line, passed in
here) as `Authorization: Bearer`, and the tool call's tier as `X-Broker-Tier`. So agent calls are admitted,
limited, coalesced and merged like any other traffic of that key's tenant and tier. `authenticate` checks
the key alone, as the broker would, before tools that need no broker call (`count_tokens`, `broker_stats`)
answer; a remote broker's acceptance is remembered for `AUTH_TTL_S`.
"""

from __future__ import annotations

from typing import Any, Protocol

import aiohttp

from mergebroker.broker.engine.limits.admission import TIER_HEADER
from mergebroker.broker.library import Broker, Reply
from mergebroker.clock import Clock, monotonic
from mergebroker.errors import BrokerError

_REPLY_HEADERS = ("x-broker-", "x-ratelimit-", "x-request-id", "retry-after")
"""The response headers a remote reply keeps: the broker's own, rate limits, the request ID."""
AUTH_TTL_S = 60.0
"""How long a remote broker's acceptance of the key is trusted before it is asked again."""


class ToolBackend(Protocol):
    """What the MCP tools call. Each method answers like the HTTP API or raises its `BrokerError`."""

    async def __aenter__(self) -> ToolBackend: ...

    async def __aexit__(self, *exc_info: object) -> None: ...

    async def authenticate(self) -> None:
        """Return when the broker accepts the key (or needs none); raise its `Unauthorized` otherwise."""

    async def chat(self, body: dict[str, Any], tier: str | None) -> Reply:
        """A `/v1/chat/completions` answer for `body`, in `tier` (None: the key's default tier)."""

    async def embeddings(self, body: dict[str, Any], tier: str | None) -> Reply:
        """A `/v1/embeddings` answer for `body`."""

    async def stats(self) -> dict[str, Any]:
        """What `/v1/broker/stats` shows."""


def caller_headers(api_key: str | None, tier: str | None) -> dict[str, str]:
    """The credentials and tier of a tool call, as request headers."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    if tier:
        headers[TIER_HEADER] = tier
    return headers


class EmbeddedBackend:
    """The broker runs in this process; started and stopped with the MCP server."""

    def __init__(self, broker: Broker, *, api_key: str | None = None) -> None:
        self._broker = broker
        self._api_key = api_key

    async def __aenter__(self) -> EmbeddedBackend:
        await self._broker.__aenter__()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._broker.__aexit__(*exc_info)

    async def authenticate(self) -> None:
        self._broker.engine.auth.authenticate(caller_headers(self._api_key, None))

    async def chat(self, body: dict[str, Any], tier: str | None) -> Reply:
        return await self._broker.chat_reply(body, caller=caller_headers(self._api_key, tier))

    async def embeddings(self, body: dict[str, Any], tier: str | None) -> Reply:
        return await self._broker.embeddings_reply(body, caller=caller_headers(self._api_key, tier))

    async def stats(self) -> dict[str, Any]:
        return self._broker.stats()


class RemoteBackend:
    """A client of a running broker at `url` (e.g. http://127.0.0.1:8080)."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float = 600.0,
                 clock: Clock = monotonic) -> None:
        self._url = url.rstrip("/")
        self._api_key = api_key
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._clock = clock
        self._accepted_until = float("-inf")

    async def __aenter__(self) -> RemoteBackend:
        # The pool is as large as the broker will admit: concurrent agent calls must reach its windows together.
        self._session = aiohttp.ClientSession(timeout=self._timeout, connector=aiohttp.TCPConnector(limit=0))
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._session is not None:
            await self._session.close()

    async def authenticate(self) -> None:
        if self._clock() < self._accepted_until:
            return
        try:
            await self._request("GET", "/v1/models", None, None)  # authenticated from the headers alone
        except BrokerError as exc:
            if exc.status in (401, 403) or self._api_key is None:
                raise
            return  # unreachable: a key cannot be checked now; tools that need the broker fail on their own
        self._accepted_until = self._clock() + AUTH_TTL_S

    async def chat(self, body: dict[str, Any], tier: str | None) -> Reply:
        return await self._request("POST", "/v1/chat/completions", body, tier)

    async def embeddings(self, body: dict[str, Any], tier: str | None) -> Reply:
        return await self._request("POST", "/v1/embeddings", body, tier)

    async def stats(self) -> dict[str, Any]:
        return (await self._request("GET", "/v1/broker/stats", None, None)).body

    async def _request(self, method: str, path: str, body: dict[str, Any] | None, tier: str | None) -> Reply:
        assert self._session is not None, "use the backend inside `async with`"
        try:
            async with self._session.request(method, self._url + path, json=body,
                                             headers=caller_headers(self._api_key, tier)) as resp:
                payload = await resp.json(content_type=None)
                headers = {k: v for k, v in resp.headers.items() if k.lower().startswith(_REPLY_HEADERS)}
                status = resp.status
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise BrokerError(f"The broker at {self._url} could not be reached or answered unreadably "
                              f"({type(exc).__name__}).", status=502, code="broker_unreachable") from exc
        if status >= 400:
            raise remote_error(status, payload)
        return Reply(payload, headers)


def remote_error(status: int, payload: Any) -> BrokerError:
    """The `BrokerError` a remote broker's error envelope describes (its status, type, code and message)."""
    error = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(error, dict):
        return BrokerError(f"The broker answered HTTP {status} without an error envelope.", status=status)
    exc = BrokerError(str(error.get("message") or f"HTTP {status}"), status=status, param=error.get("param"),
                      code=error.get("code"))
    exc.type = str(error.get("type") or exc.type)
    return exc
