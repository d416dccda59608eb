"""Thin handlers of the Batch API: `/v1/files` and `/v1/batches`, as the official OpenAI SDK calls them.

Files are per tenant (any tier of the caller may manage them); creating a batch authenticates the caller
into the bulk tier (`Settings.batch_tier`, unless `X-Broker-Tier` names another), whose merge rules the
job follows. Uploads are read part by part and refused past `batches.max_file_bytes` (413), without
holding more than the limit in memory.
"""

from __future__ import annotations

import asyncio

from aiohttp import BodyPartReader, ClientPayloadError, web
from aiohttp.http_exceptions import HttpProcessingError

from mergebroker.broker.engine.limits.admission import Caller
from mergebroker.broker.bulk.batches import BatchService
from mergebroker.broker.http.body import BODY_LIMITS, read_json
from mergebroker.broker.bulk.files import file_object, too_large
from mergebroker.broker.http.middleware import INFO
from mergebroker.broker.http.keys import BATCHES, BROKER
from mergebroker.errors import InvalidRequest, NotFound, RequestTimeout, UnsupportedMediaType

MAX_FILES_PAGE = 10_000  # as OpenAI: up to 10,000 files, 100 batches a page
MAX_BATCHES_PAGE = 100
CHUNK_BYTES = 1 << 16
FORM_OVERHEAD_BYTES = 64 * 1024
"""Room for the multipart boundaries and small fields around a file of the largest size allowed."""


def add_batch_routes(app: web.Application) -> None:
    """Register the files and batches endpoints."""
    app.router.add_post("/v1/files", upload_file)
    app.router.add_get("/v1/files", list_files)
    app.router.add_get("/v1/files/{file_id}", retrieve_file)
    app.router.add_delete("/v1/files/{file_id}", delete_file)
    app.router.add_get("/v1/files/{file_id}/content", file_content)
    app.router.add_post("/v1/batches", create_batch)
    app.router.add_get("/v1/batches", list_batches)
    app.router.add_get("/v1/batches/{batch_id}", retrieve_batch)
    app.router.add_post("/v1/batches/{batch_id}/cancel", cancel_batch)


def _service(request: web.Request, *, tier: str | None = None) -> tuple[BatchService, Caller]:
    broker = request.app[BROKER]
    service = request.app.get(BATCHES)
    if service is None:
        raise NotFound("The Batch API is not available on this broker: disabled (batches.enabled: false), or its "
                       "directory could not be opened (see the broker's log).", code="batches_unavailable")
    caller = broker.auth.authenticate(request.headers, body_tier=tier)
    request[INFO].tenant, request[INFO].tier = caller.tenant, caller.tier
    return service, caller


def _limit(request: web.Request, most: int) -> int:
    raw = request.query.get("limit", "20")
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise InvalidRequest(f"'limit' must be an integer from 1 to {most}.", param="limit")
    return int(raw)


async def upload_file(request: web.Request) -> web.Response:
    service, caller = _service(request)
    if not request.content_type.startswith("multipart/"):
        raise UnsupportedMediaType("Upload files as multipart/form-data with fields 'purpose' and 'file'.")
    limit = service.files.max_bytes
    if request.content_length is not None and request.content_length > limit + FORM_OVERHEAD_BYTES:
        raise too_large(limit)
    try:
        fields, filename, data = await _read_form(request, limit, request.app[BODY_LIMITS].timeout_s)
    except TimeoutError:
        raise RequestTimeout("The upload stalled: no data for too long.") from None
    except (ValueError, AssertionError, ClientPayloadError, HttpProcessingError):  # a malformed multipart body
        raise InvalidRequest("The body is not valid multipart/form-data.", code="invalid_multipart") from None
    if data is None:
        raise InvalidRequest("Missing the 'file' field.", param="file")
    record = await service.files.upload(caller.tenant, fields.get("purpose", ""), filename, data)
    return web.json_response(file_object(record))


async def _read_form(request: web.Request, limit: int, idle_s: float) -> tuple[dict[str, str], str, bytes | None]:
    """The form's small fields, the file's name and its bytes (at most `limit`)."""
    fields: dict[str, str] = {}
    data, filename = None, "upload.jsonl"
    async for part in await request.multipart():
        if not isinstance(part, BodyPartReader):
            continue
        if part.name == "file":
            filename = part.filename or filename
            data = await _read_limited(part, limit, idle_s)
        elif part.name:
            fields[part.name] = (await _read_limited(part, 1024, idle_s)).decode("utf-8", "replace")
    return fields, filename, data


async def _read_limited(part: BodyPartReader, limit: int, idle_s: float) -> bytes:
    """A part's bytes, refused past `limit` (413); a client silent for `idle_s` is cut off (a slow but
    moving upload of a large file is fine)."""
    chunks, size = [], 0
    while True:
        async with asyncio.timeout(idle_s):
            chunk = await part.read_chunk(CHUNK_BYTES)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)


async def list_files(request: web.Request) -> web.Response:
    service, caller = _service(request)
    limit = _limit(request, MAX_FILES_PAGE)
    records = await service.files.list(caller.tenant, purpose=request.query.get("purpose"),
                                       after=request.query.get("after"), limit=limit + 1)
    data = [file_object(r) for r in records[:limit]]
    return web.json_response({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                              "last_id": data[-1]["id"] if data else None, "has_more": len(records) > limit})


async def retrieve_file(request: web.Request) -> web.Response:
    service, caller = _service(request)
    return web.json_response(file_object(await service.files.get(caller.tenant, request.match_info["file_id"])))


async def delete_file(request: web.Request) -> web.Response:
    service, caller = _service(request)
    record = await service.files.delete(caller.tenant, request.match_info["file_id"])
    return web.json_response({"id": record.id, "object": "file", "deleted": True})


async def file_content(request: web.Request) -> web.Response:
    service, caller = _service(request)
    data = await service.files.content(caller.tenant, request.match_info["file_id"])
    return web.Response(body=data, content_type="application/jsonl")


async def create_batch(request: web.Request) -> web.Response:
    service, caller = _service(request, tier=request.app[BROKER].settings.batch_tier())
    return web.json_response(await service.create(caller, await read_json(request, request.app[BODY_LIMITS])))


async def list_batches(request: web.Request) -> web.Response:
    service, caller = _service(request)
    return web.json_response(await service.list(caller.tenant, after=request.query.get("after"),
                                                limit=_limit(request, MAX_BATCHES_PAGE)))


async def retrieve_batch(request: web.Request) -> web.Response:
    service, caller = _service(request)
    return web.json_response(await service.retrieve(caller.tenant, request.match_info["batch_id"]))


async def cancel_batch(request: web.Request) -> web.Response:
    service, caller = _service(request)
    return web.json_response(await service.cancel(caller.tenant, request.match_info["batch_id"]))

