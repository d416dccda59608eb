"""`/v1/batches`: create, retrieve, list and cancel bulk jobs; their life cycle, output files and resumption.

A batch moves validating -> in_progress -> finalizing -> completed (or cancelling -> cancelled, expired,
failed), as OpenAI's do, and always reaches one of the four final states: a failure while writing its files
fails it (`finalize_failed`), an output too large for one file fails it with every answer that did not fit
in the error file (`output_too_large`), and a broker that stops mid-way finishes it on its next start. Its
object (with `request_counts`) is kept in the batch store after every change; a broker that starts finds the
batches still active and runs them again from their unanswered lines (`broker.bulk.runner`). The input file
is pinned while the batch runs, so deleting it loses nothing; were the pinned copy gone too, the batch ends
from the answers it stored. A tenant sees only its own batches. The output file holds every line answered
2xx and the error file every other line (unsent lines of a cancelled or expired batch included), so each
`custom_id` appears exactly once across the two. A finished batch's state leaves memory (and its per-line
results leave the store, now that its files hold them). A batch holds its line count in the process's GC
policy (`mergebroker.gc_policy`) from before its lines are read until its task ends, so no full collection
walks a large batch's objects while they live.
"""

from __future__ import annotations

import asyncio
import builtins
import secrets
import sqlite3
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import structlog

from mergebroker.background import spawn
from mergebroker.broker.bulk.batch_request import WINDOWS_S, CreateRequest, check_create
from mergebroker.broker.bulk.files import BATCH_PURPOSE, FileService
from mergebroker.broker.bulk.finalize import Written, write_files
from mergebroker.broker.bulk.lines import BatchLine, LineLimits
from mergebroker.broker.bulk.runner import BulkJob, BulkRunner, Limits, Result
from mergebroker.broker.bulk.settling import CallShare
from mergebroker.broker.bulk.store import BatchRow, BatchStore, FileRecord
from mergebroker.broker.engine.accounting.costs import CostBook
from mergebroker.broker.engine.ground.logging import bind_log_context, clear_log_context
from mergebroker.broker.engine.ground.metrics import Metrics
from mergebroker.broker.engine.ground.settings import ProviderSettings, Settings
from mergebroker.broker.engine.limits.admission import Caller
from mergebroker.clock import Clock, Sleep
from mergebroker.errors import BrokerError, InvalidRequest, NotFound
from mergebroker.gc_policy import PROCESS, GcPolicy, Hold, let_go
from mergebroker.merge.embedder import Embedder
from mergebroker.providers.openai.batches import OpenAIBatchClient
from mergebroker.providers.openai.compat import HttpProviderSettings
from mergebroker.providers.pool import ProviderPools

log = structlog.get_logger(__name__)

LineHook = Callable[[BulkJob, str, int, dict[str, Any], CallShare | None], None]
"""`hook(job, custom_id, status, response body, call)`: called once per answered line; `call` is the upstream call
that answered it (None: refused before any call)."""

FINAL = ("completed", "failed", "expired", "cancelled")


@dataclass
class _Progress:
    """A running batch's answered lines (custom_id -> answered 2xx), counted once each."""

    answered: dict[str, bool] = field(default_factory=dict)
    completed: int = 0


class BatchService:
    """Owns the bulk jobs: their objects, their runs, and the clean-up of expired files."""

    def __init__(self, settings: Settings, *, store: BatchStore, files: FileService, runner: BulkRunner,
                 metrics: Metrics, sleep: Sleep, wall: Callable[[], float] = time.time, max_output_bytes: int | None = None,
                 on_line: LineHook | None = None, gc_policy: GcPolicy = PROCESS) -> None:
        self._on_line = on_line  # each line's answer, once: the usage ledger's account of it
        self._gc = gc_policy  # each running batch holds its lines, from before they are read until it ends
        self._settings = settings
        self._store = store
        self.files = files
        self._runner = runner
        self._metrics = metrics
        self._sleep = sleep
        self._wall = wall
        self._max_output_bytes = max_output_bytes or settings.batches.max_file_bytes
        self._jobs: dict[str, BulkJob] = {}
        self._progress: dict[str, _Progress] = {}
        self._rows: dict[str, BatchRow] = {}  # active batches only: a finished one is read from the store
        self._tasks: set[asyncio.Task[Any]] = set()
        self._changed: asyncio.Condition | None = None
        self._saving = asyncio.Lock()

    async def start(self) -> None:
        """Finish what a crash left half done, resume the batches a previous run left active, and start the
        expired-file clean-up."""
        self._changed = asyncio.Condition()
        active = await self._store.active_batches()
        removed = await self.files.sweep(row.id for row in active)
        if removed:
            log.info("batch_files_swept", removed=removed)
        for row in active:
            log.info("batch_resumed", batch_id=row.id, status=row.data["status"])
            self._spawn(self._resume(row), row.id, self._gc.hold(row.data["request_counts"]["total"]))
        self._spawn(self._clean_up(), "cleanup")

    def follow(self, *, pools: ProviderPools, limits: Limits, merging_allowed: Callable[[str], bool]) -> None:
        """A config reload swapped the engine: calls from now on go through its pools, limits and merge policy
        (calls already out finish on the old pools, which the reload retires once idle)."""
        self._runner.pools, self._runner.limits, self._runner.merging_allowed = pools, limits, merging_allowed

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
        request = check_create(body)
        record = await self.files.get(caller.tenant, request.input_file_id)
        if record.purpose != BATCH_PURPOSE:
            raise InvalidRequest(f"File {record.id} was not uploaded with purpose 'batch'.", param="input_file_id")
        hold = self._gc.hold(record.lines)
        try:
            row, lines = await self._created(caller, request, record)
        except BaseException:
            hold.release()
            raise
        self._spawn(self._run(row, lines), row.id, hold)
        return dict(row.data)

    async def _created(self, caller: Caller, request: CreateRequest, record: FileRecord
                       ) -> tuple[BatchRow, list[BatchLine]]:
        """Read the input's lines, then store the batch (its input pinned first); the row and the lines."""
        lines = await self.files.batch_lines(record)
        now = int(self._wall())
        data: dict[str, Any] = {"id": "batch_" + secrets.token_hex(12), "object": "batch", "endpoint": request.endpoint,
                "errors": None, "input_file_id": record.id, "completion_window": request.window,
                "status": "in_progress", "output_file_id": None, "error_file_id": None, "created_at": now,
                "in_progress_at": now, "expires_at": now + WINDOWS_S[request.window], "finalizing_at": None,
                "completed_at": None, "failed_at": None, "expired_at": None, "cancelling_at": None,
                "cancelled_at": None, "request_counts": {"total": len(lines), "completed": 0, "failed": 0},
                "metadata": request.metadata}
        row = BatchRow(data["id"], caller.tenant, caller.tier, data, asdict(caller))
        await self.files.pin(record, row.id)  # before the row: a pin without a batch is swept at the next start
        await self._save(row)
        return row, lines

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
            raise InvalidRequest(f"Cannot cancel a batch with status '{status}'.", status=409,
                              code="batch_not_cancellable")
        if status not in ("cancelling", "finalizing"):
            await self._save(row, status="cancelling", cancelling_at=int(self._wall()))
        job = self._jobs.get(batch_id)
        if job is not None:
            job.cancel.set()
        return dict(row.data)

    async def wait_until(self, batch_id: str, predicate: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """Wait until the batch's object satisfies `predicate` (for tests and embedders of the broker)."""
        assert self._changed is not None, "start() first"
        async with self._changed:  # held while checking: a change saved meanwhile notifies only once we wait
            while True:
                row = self._rows.get(batch_id) or await self._store.batch(batch_id)
                if row is not None and predicate(row.data):
                    return dict(row.data)
                await self._changed.wait()

    async def record(self, job: BulkJob, results: builtins.list[Result], call: CallShare | None = None) -> None:
        """The runner's results (`call`: the upstream call that answered them): persisted at once, counted once
        per line."""
        if not results:
            return
        await self._store.add_results(job.batch_id, results)
        progress = self._progress[job.batch_id]
        for custom_id, status, body in results:
            if custom_id in progress.answered:
                continue
            if self._on_line is not None:
                self._on_line(job, custom_id, status, body, call)
            ok = status < 300
            progress.answered[custom_id] = ok
            progress.completed += ok
            self._metrics.bulk_lines.labels("completed" if ok else "failed").inc()
        row = self._rows[job.batch_id]
        await self._save(row, request_counts={**row.data["request_counts"], "completed": progress.completed,
                                              "failed": len(progress.answered) - progress.completed})

    async def _own(self, tenant: str, batch_id: str) -> BatchRow:
        row = self._rows.get(batch_id) or await self._store.batch(batch_id)
        if row is None or row.tenant != tenant:
            raise NotFound(f"No such Batch object: {batch_id}", param="batch_id", code="batch_not_found")
        return row

    async def _save(self, row: BatchRow, **changes: Any) -> None:
        """Store the batch with `changes`; its object shows them only once the store holds them, so nobody
        reads a state (a final one above all) that a crash could still take back."""
        async with self._saving:  # in order: an earlier state never overwrites a later one in the store
            await self._store.put_batch(replace(row, data={**row.data, **changes}))
            row.data.update(changes)
        if row.data["status"] in FINAL:
            self._rows.pop(row.id, None)
        else:
            self._rows[row.id] = row
        if self._changed is not None:
            async with self._changed:
                self._changed.notify_all()

    async def _resume(self, row: BatchRow) -> None:
        lines = await self.files.pinned_lines(row.id, row.data["request_counts"]["total"])
        if lines is None:  # created before inputs were pinned, or the pinned copy is gone
            try:
                lines = await self.files.batch_lines(await self.files.get(row.tenant, row.data["input_file_id"]))
            except (BrokerError, OSError) as exc:
                log.warning("batch_input_gone", batch_id=row.id, error=type(exc).__name__)
                await self._finish(row, None, "failed", errors=[{
                    "code": "input_file_gone", "message": "The input file could not be read back: the answers "
                    "stored are in the output and error files; the other lines could not be named."}])
                return
        await self._run(row, lines)

    async def _run(self, row: BatchRow, lines: builtins.list[BatchLine]) -> None:
        clear_log_context()  # this task's own copy: the creating request's IDs go
        bind_log_context(batch_id=row.id, tenant=row.tenant)
        self._rows[row.id] = row
        custom_ids = [line.custom_id for line in lines]
        if row.data["status"] == "finalizing":  # stopped while writing its files: write them again
            await self._finish(row, custom_ids, self._ending(row))
            return
        caller = Caller(**row.caller) if row.caller else Caller(row.tenant, row.tier)
        job = BulkJob(row.id, caller, lines, float(row.data["expires_at"]), row.data["completion_window"])
        del lines
        if row.data["status"] == "cancelling":
            job.cancel.set()
        answered = await self._store.answered(row.id)
        completed = sum(answered.values())
        self._progress[row.id] = _Progress(answered, completed)
        self._jobs[row.id] = job
        self._metrics.bulk_active.inc()
        try:
            await self._runner.run(job, self, set(answered))
            status, errors = self._ending(row), None
        except asyncio.CancelledError:
            raise  # the broker is stopping: the batch stays active and resumes on the next start
        except Exception as exc:  # noqa: BLE001 - a bug fails this batch, with its answered lines kept
            log.exception("batch_failed", batch_id=row.id)
            status, errors = "failed", [{"code": "internal_error", "message": type(exc).__name__}]
        finally:
            self._metrics.bulk_active.dec()
            self._jobs.pop(row.id, None)
        lines = job.lines
        del job
        await self._finish(row, custom_ids, status, errors=errors)
        await let_go(lines)  # its lines, freed a slice per loop turn

    def _ending(self, row: BatchRow) -> str:
        """The final status of a batch whose lines are all settled or stopped."""
        if row.data["cancelling_at"] is not None:
            return "cancelled"
        return "expired" if self._wall() >= row.data["expires_at"] else "completed"

    async def _finish(self, row: BatchRow, custom_ids: builtins.list[str] | None, status: str,
                      errors: builtins.list[dict[str, str]] | None = None) -> None:
        """Write the output and error files and set the final status, whatever fails on the way."""
        errors = list(errors or [])
        if row.data["status"] != "finalizing":
            await self._save(row, status="finalizing", finalizing_at=int(self._wall()))
        total = row.data["request_counts"]["total"]
        try:
            written: Written | None = await write_files(
                self._store, self.files, batch_id=row.id, tenant=row.tenant, custom_ids=custom_ids, total=total,
                status=status, max_output_bytes=self._max_output_bytes)
        except Exception as exc:  # noqa: BLE001 - whatever fails here, the batch must still reach a final state
            log.exception("batch_files_failed", batch_id=row.id)
            written, status = None, "failed"
            errors.append({"code": "finalize_failed", "message": f"The output files could not be written "
                                                                 f"({type(exc).__name__})."})
        files: dict[str, str | None] = {}
        if written is not None:
            if written.overflow:
                status = "failed"
                errors.append({"code": "output_too_large", "message": f"{written.overflow} answered lines did not "
                               f"fit in an output file of at most {self._max_output_bytes} bytes; they are in the "
                               "error file as output_too_large."})
            files = {"output_file_id": written.output.id if written.output else None,
                     "error_file_id": written.errors.id if written.errors else None}
            completed = written.completed
        else:
            completed = (self._progress.get(row.id) or _Progress()).completed
        await self._save(row, **files, status=status, errors={"object": "list", "data": errors} if errors else None,
                         request_counts={**row.data["request_counts"], "completed": completed,
                                         "failed": total - completed}, **{f"{status}_at": int(self._wall())})
        self._metrics.bulk_batches.labels(status).inc()
        log.info("batch_ended", batch_id=row.id, status=status, completed=completed, failed=total - completed)
        self._progress.pop(row.id, None)
        await self.files.unpin(row.id)
        if written is not None:
            await self._store.forget_results(row.id)

    async def _clean_up(self) -> None:
        while True:
            try:
                removed = await self.files.clean_expired()
                if removed:
                    log.info("files_expired", removed=removed)
            except Exception as exc:  # noqa: BLE001 - a failed clean-up is retried at the next interval
                log.warning("file_cleanup_failed", error=type(exc).__name__)
            await self._sleep(self._settings.batches.cleanup_interval_s)

    def _spawn(self, coro: Any, name: str, hold: Hold | None = None) -> None:
        """Start `coro`; `hold` (a batch's lines in the GC policy) is released once it has ended, however it
        ended (started or not): the pass that follows finds the batch's objects gone."""
        task = spawn(self._tasks, coro, f"batch:{name}")
        if hold is not None:
            task.add_done_callback(lambda _task: hold.release())


def build_batch_service(settings: Settings, *, pools: ProviderPools, providers: list[ProviderSettings],
                        limits: Limits, embedder: Embedder | None, merging_allowed: Callable[[str], bool],
                        metrics: Metrics, clock: Clock, sleep: Sleep, wall: Callable[[], float] = time.time,
                        on_line: LineHook | None = None, gc_policy: GcPolicy = PROCESS,
                        costs: CostBook | None = None) -> BatchService | None:
    """The Batch API over `batches.dir` (see `BatchSettings`), or None when it is disabled; `on_line` hears of
    each line's answer once (the usage ledger); `costs` is the engine's, so bulk plans on the prices and the
    provider-cache model live merging uses."""
    b = settings.batches
    if not b.enabled:
        return None
    directory = Path(b.dir) if b.dir else (Path(settings.ledger.path).parent / "batches" if settings.ledger.path
                                           else None)
    if directory is None:
        directory = Path(tempfile.mkdtemp(prefix="mergebroker-batches-"))
        log.warning("batches_not_durable", dir=str(directory),
                    message="batches.dir is not set: Batch API files and state live in a temporary directory.")
    s = settings.server
    line_limits = LineLimits(b.max_lines, max_line_bytes=s.max_body_bytes, max_depth=s.max_json_depth,
                             max_messages=s.max_messages)  # each line as the live endpoint takes it
    try:
        store = BatchStore(directory / "batches.sqlite3")
        files = FileService(directory, store, max_bytes=b.max_file_bytes, max_lines=b.max_lines, ttl_s=b.file_ttl_s,
                            max_uploads_per_tenant=b.max_uploads_per_tenant, max_form_parts=b.max_form_parts,
                            wall=wall, line_limits=line_limits)
    except (OSError, sqlite3.Error) as exc:  # the broker still serves everything else
        log.error("batches_unavailable", dir=str(directory), error=repr(exc))
        return None
    apis = {p.name: OpenAIBatchClient(HttpProviderSettings(
        name=p.name, base_url=p.base_url, api_key=p.api_key.get_secret_value() if p.api_key else None,
        connect_timeout_s=p.connect_timeout_s)) for p in providers if p.batch_api and p.kind == "openai"}
    runner = BulkRunner(settings, pools=pools, store=store, batch_apis=apis, limits=limits,  # type: ignore
                        embedder=embedder, merging_allowed=merging_allowed, metrics=metrics, clock=clock, sleep=sleep,
                        wall=wall, costs=costs)
    return BatchService(settings, store=store, files=files, runner=runner, metrics=metrics, sleep=sleep, wall=wall,
                        on_line=on_line, gc_policy=gc_policy)
