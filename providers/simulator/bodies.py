"""Reading a request's JSON body, for every route of the simulator's OpenAI mode."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from mergebroker.errors import InvalidRequest


async def json_object(request: web.Request) -> dict[str, Any]:
    """The request's body as a JSON object; `InvalidRequest` when it is not one."""
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest("request body is not valid JSON") from exc
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return body
