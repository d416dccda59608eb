"""A minimal aiohttp reverse proxy: the floor that mergebroker's passthrough overhead is measured against.

It does the least a proxy must: one pooled `ClientSession`, POST /v1/chat/completions forwarded with its
body, and the upstream's status, body and content type sent back. No parsing, validation, limits or
retries. GET /healthz answers 200 so that the benchmark harness knows it is up.

    python -m bench.proxy_baseline --port 8002 --upstream http://127.0.0.1:8001/v1
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import AsyncIterator, Sequence

import aiohttp
from aiohttp import web

SESSION = web.AppKey("session", aiohttp.ClientSession)


def create_proxy_app(upstream_base: str) -> web.Application:
    """The proxy as an aiohttp application forwarding to `upstream_base` (an OpenAI base URL ending in /v1)."""
    target = upstream_base.rstrip("/") + "/chat/completions"
    app = web.Application()

    async def session_ctx(app: web.Application) -> AsyncIterator[None]:
        # limit=0: the proxy adds no connection cap of its own, so it never queues in front of the upstream.
        app[SESSION] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await app[SESSION].close()

    async def chat(request: web.Request) -> web.Response:
        body = await request.read()
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        try:
            async with app[SESSION].post(target, data=body, headers=headers) as upstream:
                payload = await upstream.read()
                return web.Response(body=payload, status=upstream.status,
                                    content_type=upstream.content_type or "application/json")
        except aiohttp.ClientError:
            return web.json_response({"error": {"message": "upstream unreachable", "type": "server_error",
                                                "code": "bad_gateway"}}, status=502)

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/healthz", healthz)
    return app


def main(argv: Sequence[str] | None = None) -> int:
    """Serve the proxy until interrupted."""
    parser = argparse.ArgumentParser(prog="python -m bench.proxy_baseline", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="OpenAI base URL, e.g. http://127.0.0.1:8001/v1")
    args = parser.parse_args(argv)
    web.run_app(create_proxy_app(args.upstream), host=args.host, port=args.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
