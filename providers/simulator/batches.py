"""The simulated upstream's Batch API: `/files` and `/batches`, as a provider with `batch_api: true` sees them.

A batch is run in the background by calling the simulator's own `/v1/chat/completions` once per line
(so answers, latency, faults and counters are those of live calls), at most `CONCURRENCY` at a time, then
its output and error files are written in OpenAI's batch output format. Tests hold batches in progress
with `POST /control/batches {"hold": true}` (and release them with false); `GET /control/batches`
shows that flag and the counters (files uploaded, batches created, lines run).
"""

from __future__ import annotations

import asyncio
import builtins
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import BodyPartReader, web

from mergebroker.background import spawn
from mergebroker.errors import InvalidRequest, NotFound

CONCURRENCY = 16
FINAL = ("completed", "failed", "expired", "cancelled")


@dataclass
class _File:
    id: str
    purpose: str
    filename: str
    data: bytes
    created_at: int = field(default_factory=lambda: int(time.time()))

    def as_object(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": len(self.data), "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed"}


class SimulatedBatches:
    """The files and batches of one simulator, and the background runs of its batches."""

    def __init__(self) -> None:
        self.files: dict[str, _File] = {}
        self.batches: dict[str, dict[str, Any]] = {}
        self.counters = {"files_uploaded": 0, "batches_created": 0, "lines_run": 0}
        self._released = asyncio.Event()
        self._released.set()
        self._tasks: set[asyncio.Task[Any]] = set()

    def routes(self) -> list[web.RouteDef]:
        """The routes, each served with and without the /v1 prefix."""
        table = [("POST", "/files", self.upload), ("GET", "/files/{id}", self.get_file),
                 ("DELETE", "/files/{id}", self.delete_file), ("GET", "/files/{id}/content", self.content),
                 ("POST", "/batches", self.create), ("GET", "/batches", self.list),
                 ("GET", "/batches/{id}", self.retrieve), ("POST", "/batches/{id}/cancel", self.cancel)]
        routes = [web.route(m, prefix + path, h) for prefix in ("", "/v1") for m, path, h in table]
        return routes + [web.get("/control/batches", self.get_control), web.post("/control/batches", self.post_control)]

    async def close(self) -> None:
        """Stop the background runs."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def upload(self, request: web.Request) -> web.Response:
        fields: dict[str, bytes] = {}
        filename = "upload.jsonl"
        async for part in await request.multipart():
            if isinstance(part, BodyPartReader) and part.name:
                filename = part.filename or filename if part.name == "file" else filename
                fields[part.name] = await part.read()
        if "file" not in fields:
            raise InvalidRequest("missing the 'file' field", param="file")
        record = _File("file-sim-" + secrets.token_hex(8), fields.get("purpose", b"").decode(), filename, fields["file"])
        self.files[record.id] = record
        self.counters["files_uploaded"] += 1
        return web.json_response(record.as_object())

    def _file(self, request: web.Request) -> _File:
        record = self.files.get(request.match_info["id"])
        if record is None:
            raise NotFound(f"No such File object: {request.match_info['id']}")
        return record

    async def get_file(self, request: web.Request) -> web.Response:
        return web.json_response(self._file(request).as_object())

    async def delete_file(self, request: web.Request) -> web.Response:
        record = self.files.pop(self._file(request).id)
        return web.json_response({"id": record.id, "object": "file", "deleted": True})

    async def content(self, request: web.Request) -> web.Response:
        return web.Response(body=self._file(request).data, content_type="application/jsonl")

    async def create(self, request: web.Request) -> web.Response:
        body = await request.json()
        source = self.files.get(str(body.get("input_file_id")))
        if source is None:
            raise NotFound("input file not found", param="input_file_id")
        now = int(time.time())
        batch = {"id": "batch_sim_" + secrets.token_hex(8), "object": "batch", "endpoint": body.get("endpoint"),
                 "input_file_id": source.id, "completion_window": body.get("completion_window"),
                 "status": "in_progress", "created_at": now, "output_file_id": None, "error_file_id": None,
                 "request_counts": {"total": 0, "completed": 0, "failed": 0}}
        self.batches[batch["id"]] = batch
        self.counters["batches_created"] += 1
        spawn(self._tasks, self._run(batch, source.data, str(request.url.origin())), f"sim-batch-{batch['id']}")
        return web.json_response(batch)

    def _batch(self, request: web.Request) -> dict[str, Any]:
        batch = self.batches.get(request.match_info["id"])
        if batch is None:
            raise NotFound(f"No such Batch object: {request.match_info['id']}")
        return batch

    async def retrieve(self, request: web.Request) -> web.Response:
        return web.json_response(self._batch(request))

    async def list(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": list(self.batches.values()), "has_more": False})

    async def cancel(self, request: web.Request) -> web.Response:
        batch = self._batch(request)
        if batch["status"] not in FINAL:
            batch["status"] = "cancelling"
        return web.json_response(batch)

    async def get_control(self, request: web.Request) -> web.Response:
        return web.json_response({"hold": not self._released.is_set(), **self.counters})

    async def post_control(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("hold"):
            self._released.clear()
        else:
            self._released.set()
        return await self.get_control(request)

    async def _run(self, batch: dict[str, Any], data: bytes, origin: str) -> None:
        """Answer every line through the simulator's own chat endpoint, then write the result files."""
        await self._released.wait()
        lines = [json.loads(line) for line in data.decode().splitlines() if line.strip()]
        batch["request_counts"]["total"] = len(lines)
        slots = asyncio.Semaphore(CONCURRENCY)
        outputs: list[dict[str, Any]] = []
        async with aiohttp.ClientSession() as session:
            async def one(line: dict[str, Any]) -> None:
                async with slots:
                    if batch["status"] != "in_progress":
                        return  # cancelled: lines not yet started are never run
                    try:
                        async with session.post(origin + "/v1/chat/completions", json=line["body"]) as resp:
                            status, body = resp.status, await resp.json(content_type=None)
                    except (aiohttp.ClientError, ValueError) as exc:  # a faulted line fails alone, not the batch
                        status, body = 500, {"error": {"message": type(exc).__name__, "type": "server_error"}}
                    outputs.append({"id": "batch_req_" + secrets.token_hex(8), "custom_id": line["custom_id"],
                                    "response": {"status_code": status, "body": body}, "error": None})
                    self.counters["lines_run"] += 1
            await asyncio.gather(*(one(line) for line in lines))
        self._finish(batch, outputs)

    def _finish(self, batch: dict[str, Any], outputs: builtins.list[dict[str, Any]]) -> None:
        good = [o for o in outputs if o["response"]["status_code"] == 200]
        bad = [o for o in outputs if o["response"]["status_code"] != 200]
        for key, rows in (("output_file_id", good), ("error_file_id", bad)):
            if rows:
                record = _File("file-sim-" + secrets.token_hex(8), "batch_output", f"{batch['id']}_{key}.jsonl",
                               "".join(json.dumps(r) + "\n" for r in rows).encode())
                self.files[record.id] = record
                batch[key] = record.id
        batch["request_counts"].update(completed=len(good), failed=len(bad))
        batch["status"] = "cancelled" if batch["status"] == "cancelling" else "completed"


BATCHES_KEY = web.AppKey("simulated_batches", SimulatedBatches)


def add_batch_routes(app: web.Application) -> None:
    """Serve the Batch API on the simulator's application (its runs stop when the application shuts down)."""
    batches = app[BATCHES_KEY] = SimulatedBatches()
    app.add_routes(batches.routes())

    async def stop(_: web.Application) -> None:
        await batches.close()

    app.on_shutdown.append(stop)
