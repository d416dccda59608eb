"""Thin handlers of the Batch API: `/v1/files` and `/v1/batches`, as the official OpenAI SDK calls them.

Files are per tenant (any tier of the caller may manage them); creating a batch authenticates the caller
into the bulk tier (`Settings.batch_tier`, unless `X-Broker-Tier` names another), whose merge rules the
job follows. Uploads stream to disk through `http.uploads` (inflated, bounded, refused past
`batches.max_file_bytes` with 413) and are kept only once every line passed its checks; contents stream back
from disk.
"""

from __future__ import annotations

from aiohttp import web

from mergebroker.broker.bulk.batches import BatchService
from mergebroker.broker.bulk.files import file_object, too_large
from mergebroker.broker.engine.limits.admission import Caller
from mergebroker.broker.http.body import BODY_LIMITS, read_json
from mergebroker.broker.http.keys import BATCHES, BROKER
from mergebroker.broker.http.middleware import INFO
from mergebroker.broker.http.uploads import FORM_OVERHEAD_BYTES, body_encoding, read_form
from mergebroker.errors import InvalidRequest, NotFound, UnsupportedMediaType

MAX_FILES_PAGE = 10_000  # as OpenAI: up to 10,000 files, 100 batches a page
MAX_BATCHES_PAGE = 100


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
    encoding = body_encoding(request)
    limit = service.files.max_bytes
    if request.content_length is not None and request.content_length > limit + FORM_OVERHEAD_BYTES:
        raise too_large(limit)
    async with service.files.receive(caller.tenant) as incoming:
        form = await read_form(request, incoming, encoding=encoding, max_bytes=limit + FORM_OVERHEAD_BYTES,
                               max_parts=service.files.max_form_parts, idle_s=request.app[BODY_LIMITS].timeout_s)
        if not form.has_file:
            raise InvalidRequest("Missing the 'file' field.", param="file")
        record = await service.files.commit(caller.tenant, incoming, purpose=form.fields.get("purpose", ""),
                                            filename=form.filename)
    return web.json_response(file_object(record))


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


async def file_content(request: web.Request) -> web.StreamResponse:
    service, caller = _service(request)
    record = await service.files.get(caller.tenant, request.match_info["file_id"])
    # Streamed from disk: a large output file is never read into memory.
    return web.FileResponse(service.files.content_path(record), headers={"Content-Type": "application/jsonl"})


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

