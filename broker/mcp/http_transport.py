"""The MCP server over streamable HTTP, behind its own bearer token.

Every caller of the HTTP transport is served with the server's broker key, so the transport takes a token of
its own (read from the variable `mcp.http_token_env` names): each request must carry `Authorization: Bearer <token>`, compared in constant time
(`hmac.compare_digest`), or it gets 401 before the MCP app sees it. Without a token the transport binds only
to a loopback address (`bind_check`), where only this machine's users can reach it.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from collections.abc import Awaitable, Callable
from typing import Any

from mcp.server.mcpserver import MCPServer

from mergebroker.errors import error_body

Scope = dict[str, Any]
Asgi = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


def is_loopback(host: str) -> bool:
    """Whether `host` names only this machine (127.0.0.0/8, ::1, localhost)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name that may resolve anywhere, or every interface ("" / "0.0.0.0" are not loopback)


def bind_check(host: str, token: str | None, *, token_env: str) -> str | None:
    """Why the HTTP transport may not listen on `host` with `token` (None: it may); the refusal names
    `token_env`, the variable the token is read from."""
    if token or is_loopback(host):
        return None
    return (f"mergebroker mcp: the HTTP transport serves every caller with the broker key, so it listens beyond "
            f"loopback ({host!r}) only with a bearer token: set ${token_env}, or listen on 127.0.0.1.")


class BearerGate:
    """ASGI middleware: HTTP requests without `Authorization: Bearer <token>` get 401; the rest pass to `app`."""

    def __init__(self, app: Asgi, token: str) -> None:
        self._app = app
        self._expected = b"Bearer " + token.encode()

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] == "http" and not self._allowed(scope):
            body = json.dumps(error_body("This MCP server needs 'Authorization: Bearer <token>'.",
                                         "invalid_request_error", None, "invalid_mcp_token")).encode()
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
            await send({"type": "http.response.body", "body": body})
            return
        await self._app(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        given = b"".join(v for k, v in scope.get("headers", ()) if k.lower() == b"authorization")
        return hmac.compare_digest(given, self._expected)


async def serve_http(server: MCPServer, *, host: str, port: int, token: str | None, token_env: str) -> None:
    """Serve `server` over streamable HTTP at `host:port/mcp` until stopped (after `bind_check`)."""
    import uvicorn

    refusal = bind_check(host, token, token_env=token_env)
    if refusal is not None:
        raise PermissionError(refusal)
    app: Asgi = server.streamable_http_app(host=host)
    if token:
        app = BearerGate(app, token)
    await uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning")).serve()
