"""`/v1/batches`: create, retrieve, list and cancel bulk jobs; their life cycle, output files and resumption.

A batch moves validating -> in_progress -> finalizing -> completed (or cancelling -> cancelled, expired,
failed), as OpenAI's do. Its object (with `request_counts`) is kept in the batch store after every
change; a broker that starts finds the batches still active and runs them again from their unanswered
lines (`broker.bulk.runner`). A tenant sees only its own batches. The output file holds every line
answered 2xx and the error file every other line (unsent lines of a cancelled or expired batch
included), so each `custom_id` appears exactly once across the two.
"""

from __future__ import annotations

import asyncio
import secrets
import sqlite3
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import structlog

from mergebroker.broker.engine.limits.admission import Caller
from mergebroker.background import spawn
from mergebroker.broker.bulk.lines import BatchLine, jsonl, output_line
from mergebroker.broker.bulk.runner import BulkJob, BulkRunner, Limits, Result
from mergebroker.broker.bulk.store import BatchRow, BatchStore
from mergebroker.broker.bulk.files import BATCH_PURPOSE, FileService
from mergebroker.broker.engine.metrics import Metrics
from mergebroker.broker.engine.settings import ProviderSettings, Settings
from mergebroker.clock import Clock, Sleep
from mergebroker.errors import BrokerError, InvalidRequest, NotFound
from mergebroker.merge.embedder import Embedder
from mergebroker.providers.openai_batches import OpenAIBatchClient
from mergebroker.providers.openai_compat import HttpProviderSettings
from mergebroker.providers.pool import ProviderPools

log = structlog.get_logger(__name__)

WINDOWS_S = {"24h": 24 * 3600}
FINAL = ("completed", "failed", "expired", "cancelled")
UNSENT = {"cancelled": ("batch_cancelled", "The batch was cancelled before this request was sent."),
          "expired": ("batch_expired", "The batch's completion window ended before this request was sent."),
          "failed": ("batch_failed", "The batch failed before this request was answered.")}


class BatchService:
    """Owns the bulk jobs: their objects, their runs, and the clean-up of expired files."""

    def __init__(self, settings: Settings, *, store: BatchStore, files: FileService, runner: BulkRunner,
                 metrics: Metrics, sleep: Sleep, wall: Clock = time.time) -> None:
        self._settings = settings
        self._store = store
        self.files = files
        self._runner = runner
        self._metrics = metrics
        self._sleep = sleep
        self._wall = wall
        self._jobs: dict[str, BulkJob] = {}
        self._answered: dict[str, dict[str, bool]] = {}  # batch -> custom_id -> answered 2xx
        self._rows: dict[str, BatchRow] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._changed: asyncio.Condition | None = None

    async def start(self) -> None:
        """Resume the batches a previous run left active, and start the expired-file clean-up."""
        self._changed = asyncio.Condition()
        for row in await self._store.active_batches():
            log.info("batch_resumed", batch_id=row.id, status=row.data["status"])
            self._spawn(self._resume(row), row.id)
        self._spawn(self._clean_up(), "cleanup")

    async def stop(self) -> None:
        """Stop every run where it stands; the next start resumes them."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for runner_api in self._runner.batch_apis.values():
            await runner_api.close()
        self._store.close()

    async def create(self, caller: Caller, body: Any) -> dict[str, Any]:
        """Check the request and its input file, store the batch, start it; the batch object."""
        if not isinstance(body, dict):
            raise InvalidRequest("The request body must be a JSON object.", code="invalid_body")
        endpoint, window, metadata = body.get("endpoint"), body.get("completion_window"), body.get("metadata")
        if endpoint != "/v1/chat/completions":
            raise InvalidRequest(f"Unsupported endpoint {endpoint!r}: use '/v1/chat/completions'.", param="endpoint",
                                 code="unsupported_endpoint")
        if window not in WINDOWS_S:
            raise InvalidRequest(f"Unsupported completion_window {window!r}: use '24h'.", param="completion_window")
        if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
                isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
            raise InvalidRequest("'metadata' must be an object of at most 16 string values.", param="metadata")
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str) or not file_id:
            raise InvalidRequest("Missing required parameter: 'input_file_id'.", param="input_file_id")
        record = await self.files.get(caller.tenant, file_id)
        if record.purpose != BATCH_PURPOSE:
            raise InvalidRequest(f"File {file_id} was not uploaded with purpose 'batch'.", param="input_file_id")
        lines = await self.files.batch_lines(record)
        now = int(self._wall())
        data = {"id": "batch_" + secrets.token_hex(12), "object": "batch", "endpoint": endpoint, "errors": None,
                "input_file_id": record.id, "completion_window": window, "status": "in_progress",
                "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": now,
                "expires_at": now + WINDOWS_S[window], "finalizing_at": None, "completed_at": None,
                "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                "request_counts": {"total": len(lines), "completed": 0, "failed": 0}, "metadata": metadata}
        row = BatchRow(data["id"], caller.tenant, caller.tier, data, asdict(caller))
        await self._save(row)
        self._spawn(self._run(row, lines), row.id)
        return dict(data)

    async def retrieve(self, tenant: str, batch_id: str) -> dict[str, Any]:
        """The tenant's batch object, or 404 (for another tenant's batch too)."""
        return dict((await self._own(tenant, batch_id)).data)

    async def list(self, tenant: str, *, after: str | None, limit: int) -> dict[str, Any]:
        """A page of the tenant's batches, newest first."""
        rows = await self._store.batches(tenant, after=after, limit=limit + 1)
        data = [self._rows.get(r.id, r).data for r in rows[:limit]]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > limit}

    async def cancel(self, tenant: str, batch_id: str) -> dict[str, Any]:
        """Stop sending the batch's work; lines already answered keep their answers."""
        row = await self._own(tenant, batch_id)
        status = row.data["status"]
        if status in FINAL:
            raise BrokerError(f"Cannot cancel a batch with status '{status}'.", status=409,
                              code="batch_not_cancellable")
        if status != "cancelling":
            row.data.update(status="cancelling", cancelling_at=int(self._wall()))
            await self._save(row)
        job = self._jobs.get(batch_id)
        if job is not None:
            job.cancel.set()
        return dict(row.data)

    async def wait_until(self, batch_id: str, predicate: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """Wait until the batch's object satisfies `predicate` (for tests and embedders of the broker)."""
        assert self._changed is not None, "start() first"
        async with self._changed:
            await self._changed.wait_for(lambda: batch_id in self._rows and predicate(self._rows[batch_id].data))
        return dict(self._rows[batch_id].data)

    async def record(self, job: BulkJob, results: list[Result]) -> None:
        """The runner's results: persisted at once, counted once per line."""
        if not results:
            return
        await self._store.add_results(job.batch_id, results)
        answered = self._answered.setdefault(job.batch_id, {})
        fresh = [(cid, status < 300) for cid, status, _ in results if cid not in answered]
        answered.update(fresh)
        for _, ok in fresh:
            self._metrics.bulk_lines.labels("completed" if ok else "failed").inc()
        row = self._rows[job.batch_id]
        counts = row.data["request_counts"]
        counts["completed"] = sum(answered.values())
        counts["failed"] = len(answered) - counts["completed"]
        await self._save(row)

    async def _own(self, tenant: str, batch_id: str) -> BatchRow:
        row = self._rows.get(batch_id) or await self._store.batch(batch_id)
        if row is None or row.tenant != tenant:
            raise NotFound(f"No such Batch object: {batch_id}", param="batch_id", code="batch_not_found")
        return row

    async def _save(self, row: BatchRow) -> None:
        self._rows[row.id] = row
        await self._store.put_batch(row)
        if self._changed is not None:
            async with self._changed:
                self._changed.notify_all()

    async def _resume(self, row: BatchRow) -> None:
        try:
            record = await self.files.get(row.tenant, row.data["input_file_id"])
            lines = await self.files.batch_lines(record)
        except (BrokerError, OSError) as exc:
            log.warning("batch_input_gone", batch_id=row.id, error=type(exc).__name__)
            self._rows[row.id] = row
            await self._end(row, [], "failed", errors=[{"code": "input_file_gone", "message": str(exc)}])
            return
        await self._run(row, lines)

    async def _run(self, row: BatchRow, lines: list[BatchLine]) -> None:
        structlog.contextvars.clear_contextvars()  # this task's own copy: the creating request's IDs go
        structlog.contextvars.bind_contextvars(batch_id=row.id, tenant=row.tenant)
        caller = Caller(**row.caller) if row.caller else Caller(row.tenant, row.tier)
        job = BulkJob(row.id, caller, lines, float(row.data["expires_at"]), row.data["completion_window"])
        self._jobs[row.id] = job
        self._rows[row.id] = row
        if row.data["status"] == "cancelling":
            job.cancel.set()
        results = await self._store.results(row.id)
        self._answered[row.id] = {cid: status < 300 for cid, (status, _) in results.items()}
        self._metrics.bulk_active.inc()
        try:
            await self._runner.run(job, self, set(results))
            status = "cancelled" if job.cancel.is_set() else "expired" if self._wall() >= job.expires_at else "completed"
            await self._end(row, lines, status)
        except asyncio.CancelledError:
            raise  # the broker is stopping: the batch stays active and resumes on the next start
        except Exception as exc:  # noqa: BLE001 - a bug fails this batch, with its answered lines kept
            log.exception("batch_failed", batch_id=row.id)
            await self._end(row, lines, "failed", errors=[{"code": "internal_error", "message": type(exc).__name__}])
        finally:
            self._metrics.bulk_active.dec()
            self._jobs.pop(row.id, None)

    async def _end(self, row: BatchRow, lines: list[BatchLine], status: str, errors: list | None = None) -> None:
        """Write the output and error files and set the final status."""
        now = int(self._wall())
        row.data.update(status="finalizing", finalizing_at=now)
        await self._save(row)
        results = await self._store.results(row.id)
        good, bad = [], []
        for line in lines:
            found = results.get(line.custom_id)
            if found is None:
                code, message = UNSENT[status if status in UNSENT else "failed"]
                bad.append({"id": "batch_req_" + secrets.token_hex(12), "custom_id": line.custom_id,
                            "response": None, "error": {"code": code, "message": message}})
            else:
                (good if found[0] < 300 else bad).append(output_line(line.custom_id, *found))
        for key, rows, name in (("output_file_id", good, "output"), ("error_file_id", bad, "error")):
            if rows:
                saved = await self.files.save_output(row.tenant, f"{row.id}_{name}.jsonl", jsonl(rows), len(rows))
                row.data[key] = saved.id
        row.data["request_counts"].update(completed=len(good), failed=len(bad))
        row.data.update(status=status, errors={"object": "list", "data": errors} if errors else None)
        row.data[f"{status}_at"] = int(self._wall())
        self._metrics.bulk_batches.labels(status).inc()
        log.info("batch_ended", batch_id=row.id, status=status, completed=len(good), failed=len(bad))
        await self._save(row)

    async def _clean_up(self) -> None:
        while True:
            try:
                removed = await self.files.clean_expired()
                if removed:
                    log.info("files_expired", removed=removed)
            except Exception as exc:  # noqa: BLE001 - a failed clean-up is retried at the next interval
                log.warning("file_cleanup_failed", error=type(exc).__name__)
            await self._sleep(self._settings.batches.cleanup_interval_s)

    def _spawn(self, coro: Any, name: str) -> None:
        spawn(self._tasks, coro, f"batch:{name}")


def build_batch_service(settings: Settings, *, pools: ProviderPools, providers: list[ProviderSettings],
                        limits: Limits, embedder: Embedder | None, merging_allowed: Callable[[str], bool],
                        metrics: Metrics, clock: Clock, sleep: Sleep, wall: Clock = time.time) -> BatchService | None:
    """The Batch API over `batches.dir` (see `BatchSettings`), or None when it is disabled."""
    b = settings.batches
    if not b.enabled:
        return None
    directory = Path(b.dir) if b.dir else (Path(settings.ledger.path).parent / "batches" if settings.ledger.path
                                           else None)
    if directory is None:
        directory = Path(tempfile.mkdtemp(prefix="mergebroker-batches-"))
        log.warning("batches_not_durable", dir=str(directory),
                    message="batches.dir is not set: Batch API files and state live in a temporary directory.")
    try:
        store = BatchStore(directory / "batches.sqlite3")
        files = FileService(directory, store, max_bytes=b.max_file_bytes, max_lines=b.max_lines, ttl_s=b.file_ttl_s,
                            wall=wall)
    except (OSError, sqlite3.Error) as exc:  # the broker still serves everything else
        log.error("batches_unavailable", dir=str(directory), error=repr(exc))
        return None
    apis = {p.name: OpenAIBatchClient(HttpProviderSettings(
        name=p.name, base_url=p.base_url, api_key=p.api_key.get_secret_value() if p.api_key else None,
        connect_timeout_s=p.connect_timeout_s)) for p in providers if p.batch_api and p.kind == "openai"}
    runner = BulkRunner(settings, pools=pools, store=store, batch_apis=apis, limits=limits,  # type: ignore
                        embedder=embedder, merging_allowed=merging_allowed, metrics=metrics, clock=clock, sleep=sleep, wall=wall)
    return BatchService(settings, store=store, files=files, runner=runner, metrics=metrics, sleep=sleep, wall=wall)
