"""The `mergebroker mcp` command: its options, and running the MCP server with its backend.

Kept apart from `mcp_server` so that `mergebroker --help` works without the optional `mcp` extra.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

from mergebroker.broker.engine.ground.config import settings_for_command
from mergebroker.broker.engine.ground.settings import McpSettings, Settings

MISSING_EXTRA = "mergebroker mcp needs the MCP SDK: install the extra with  pip install 'mergebroker[mcp]'"


def add_mcp_arguments(parser: argparse.ArgumentParser) -> None:
    """The `mergebroker mcp` options; each wins over its `mcp.*` setting."""
    parser.add_argument("--config", metavar="FILE", help="YAML config file (default: $MERGEBROKER_CONFIG)")
    parser.add_argument("--transport", choices=["stdio", "http"], help="stdio (default) or streamable HTTP")
    parser.add_argument("--host", help="HTTP transport: listen address (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, help="HTTP transport: listen port (default: 8090); the endpoint is /mcp")
    parser.add_argument("--broker", metavar="URL", help="call a running broker at URL instead of running one here")
    parser.add_argument("--api-key-env", metavar="NAME",
                        help="environment variable with the broker API key (default: MERGEBROKER_API_KEY)")


def mcp_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings that `mcp`'s flags set."""
    flags = {"transport": args.transport, "host": args.host, "port": args.port, "broker_url": args.broker,
             "api_key_env": args.api_key_env}
    chosen = {name: value for name, value in flags.items() if value is not None}
    return {"mcp": chosen} if chosen else {}


def run_mcp(args: argparse.Namespace) -> int:
    """Run the MCP server until its transport ends (stdin closed, or the HTTP server stopped)."""
    from mergebroker.broker.engine.ground.logging import configure_logging

    settings = settings_for_command(args.config, overrides=mcp_overrides(args))
    if settings is None:
        return 2
    try:
        import mcp  # noqa: F401 - only to say clearly when the extra is missing
    except ModuleNotFoundError:
        print(MISSING_EXTRA, file=sys.stderr)
        return 2
    from mergebroker.broker.mcp.http_transport import bind_check

    token_env = settings.mcp.http_token_env
    token = os.environ.get(token_env) or None
    refusal = bind_check(settings.mcp.host, token, token_env=token_env) if settings.mcp.transport == "http" else None
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
    configure_logging(settings.logging.level, json_lines=settings.logging.json_lines,
                      request_lines_per_s=settings.logging.request_lines_per_s)  # stderr: stdout is MCP's
    try:
        asyncio.run(serve(settings, api_key=os.environ.get(settings.mcp.api_key_env) or None, http_token=token))
    except KeyboardInterrupt:
        pass
    return 0


async def serve(settings: Settings, *, api_key: str | None, http_token: str | None = None) -> None:
    """Start the backend (the embedded broker, or a client of `mcp.broker_url`) and serve MCP over it (over HTTP
    behind `http_token`, when given: see `broker.mcp.http_transport`)."""
    from mergebroker.broker.library import Broker
    from mergebroker.broker.mcp.backend import EmbeddedBackend, RemoteBackend, ToolBackend
    from mergebroker.broker.mcp.http_transport import serve_http
    from mergebroker.broker.mcp.server import build_server

    mcp: McpSettings = settings.mcp
    backend: ToolBackend = (RemoteBackend(mcp.broker_url, api_key=api_key) if mcp.broker_url
                            else EmbeddedBackend(Broker(settings), api_key=api_key))
    server = build_server(backend, mcp)
    async with backend:
        if mcp.transport == "stdio":
            await server.run_stdio_async()
        else:
            await serve_http(server, host=mcp.host, port=mcp.port, token=http_token, token_env=mcp.http_token_env)
