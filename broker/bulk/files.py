"""`/v1/files` for the Batch API: files on disk, their records in the batch store, one owner each.

A tenant sees only its own files: another tenant's file ID is answered exactly like an unknown one (404),
so IDs reveal nothing. An upload streams to a temporary file (`Incoming`, at most `max_bytes`, a few at a
time per tenant); its name and every line are checked (`broker.bulk.lines`) before anything is kept, and the
temporary file becomes the file only after its record commits. So no failure leaves bytes nobody lists: a
crash between the two is finished (or undone) by `sweep` at the next start. Output and error files are
written the same way (`Outgoing`). A batch pins its input file (a hard link) while it runs, so deleting or
expiring the file never takes the batch's lines away. Every file expires `file_ttl_s` after it was created
and `clean_expired` removes it (record and bytes). Disk work runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import IO, Any

import structlog

from mergebroker.broker.bulk.lines import BatchLine, LineLimits, count_batch_file, read_batch_file
from mergebroker.broker.bulk.store import BatchStore, FileRecord
from mergebroker.errors import InvalidRequest, NotFound, RateLimited

log = structlog.get_logger(__name__)

BATCH_PURPOSE = "batch"
OUTPUT_PURPOSE = "batch_output"
MAX_FILENAME_CHARS = 255
WRITE_CHUNK_BYTES = 1 << 20
"""Bytes an upload gathers before a worker thread writes them out."""
READ_BUFFER_BYTES = 1 << 20
"""The buffer a file is read through line by line in a worker thread. At the default 8 KiB, each refill is
a read that lets go of the GIL and takes it straight back, about once a millisecond; a thread waiting for
the GIL asks the holder to hand it over only after 5 ms without a release, so the event loop's thread
starved for up to 1.1 s while a 50,000-line file was checked. At 1 MiB the reads are rare and the loop
waits ~13 ms at most (measured beside a 5 ms ticker thread)."""
PARTIAL = ".partial"


class FileService:
    """Stores, checks, lists and expires a tenant's files."""

    def __init__(self, directory: Path, store: BatchStore, *, max_bytes: int, max_lines: int, ttl_s: float,
                 max_uploads_per_tenant: int, max_form_parts: int, wall: Callable[[], float] = time.time,
                 line_limits: LineLimits | None = None) -> None:
        self._dir = directory / "files"
        self._dir.mkdir(parents=True, exist_ok=True)
        self._pins = directory / "inputs"
        self._pins.mkdir(parents=True, exist_ok=True)
        self._store = store
        self.max_bytes = max_bytes
        self.max_form_parts = max_form_parts
        """The most parts an upload's form may hold (the HTTP reader checks it as the form streams in)."""
        self._limits = line_limits or LineLimits(max_lines)
        self._ttl_s = ttl_s
        self._wall = wall
        self._max_uploads = max_uploads_per_tenant
        self._uploading: Counter[str] = Counter()

    @contextlib.asynccontextmanager
    async def receive(self, tenant: str) -> AsyncIterator[Incoming]:
        """A temporary file for one upload of `tenant` (429 when it already streams its most at once);
        removed at the end of the block unless `commit` kept it."""
        if self._uploading[tenant] >= self._max_uploads:
            raise RateLimited(f"Too many uploads at once: at most {self._max_uploads} per tenant. Retry when one "
                              "has finished.", retry_after=1.0, code="too_many_uploads")
        self._uploading[tenant] += 1
        incoming = Incoming(self._path("file-" + secrets.token_hex(12), PARTIAL), self.max_bytes)
        try:
            yield incoming
        finally:
            self._uploading[tenant] -= 1
            if not self._uploading[tenant]:
                del self._uploading[tenant]
            await asyncio.to_thread(incoming.discard)

    async def commit(self, tenant: str, incoming: Incoming, *, purpose: str, filename: str) -> FileRecord:
        """Check an upload's purpose, name and every line, then keep it: the record first, then the bytes."""
        if purpose != BATCH_PURPOSE:
            raise InvalidRequest(f"Unsupported purpose {purpose[:40]!r}: this broker stores files for 'batch' only.",
                                 param="purpose", code="invalid_purpose")
        name = check_filename(filename)
        await asyncio.to_thread(incoming.close)
        lines = await asyncio.to_thread(_count_lines, incoming.path, self._limits)
        return await self._keep(incoming, tenant, BATCH_PURPOSE, name, lines)

    async def upload(self, tenant: str, purpose: str, filename: str, data: bytes) -> FileRecord:
        """Store an uploaded batch input file already in memory (the library's and tests' way in)."""
        async with self.receive(tenant) as incoming:
            await incoming.write(data)
            return await self.commit(tenant, incoming, purpose=purpose, filename=filename)

    @contextlib.asynccontextmanager
    async def output(self, tenant: str, filename: str) -> AsyncIterator[Outgoing]:
        """An output or error file being written for a batch; `Outgoing.keep` stores it."""
        outgoing = Outgoing(self, tenant, filename, self._path("file-" + secrets.token_hex(12), PARTIAL))
        try:
            yield outgoing
        finally:
            await asyncio.to_thread(outgoing.incoming.discard)

    async def _keep(self, incoming: Incoming, tenant: str, purpose: str, filename: str, lines: int) -> FileRecord:
        now = int(self._wall())
        record = FileRecord(incoming.path.stem, tenant, purpose, filename, incoming.size, now, now + int(self._ttl_s),
                            lines)
        incoming.committing = True  # from here `_commit` owns the temporary file, whatever happens to the caller
        return await asyncio.shield(self._commit(incoming, record))  # a client leaving cannot cut it in half

    async def _commit(self, incoming: Incoming, record: FileRecord) -> FileRecord:
        """The record, then the bytes under its ID; on a failure, neither."""
        try:
            await self._store.add_file(record)
        except BaseException:
            await asyncio.to_thread(incoming.discard, force=True)
            raise
        try:
            await asyncio.to_thread(incoming.path.replace, self._path(record.id))
        except BaseException:
            await self._store.delete_file(record.id)  # no record without its bytes
            await asyncio.to_thread(incoming.discard, force=True)
            raise
        return record

    async def get(self, tenant: str, file_id: str) -> FileRecord:
        """The tenant's file, or 404 (for another tenant's file too)."""
        record = await self._store.file(file_id)
        if record is None or record.tenant != tenant or record.expires_at <= self._wall():
            raise NotFound(f"No such File object: {file_id}", param="file_id", code="file_not_found")
        return record

    async def content(self, tenant: str, file_id: str) -> bytes:
        """The bytes of the tenant's file."""
        return await asyncio.to_thread(self.content_path(await self.get(tenant, file_id)).read_bytes)

    def content_path(self, record: FileRecord) -> Path:
        """Where a record's bytes are (to stream them)."""
        return self._path(record.id)

    async def batch_lines(self, record: FileRecord) -> list[BatchLine]:
        """The requests of a stored batch input file (checked again, as the runner reads it)."""
        return await asyncio.to_thread(_read_lines, self._path(record.id), self._run_limits(record.lines))

    async def pin(self, record: FileRecord, batch_id: str) -> None:
        """Keep the input file's bytes for `batch_id` while it runs, whatever happens to the file."""
        await asyncio.to_thread(_link_or_copy, self._path(record.id), self._pins / f"{batch_id}.jsonl")

    async def pinned_lines(self, batch_id: str, lines: int) -> list[BatchLine] | None:
        """The requests of the input `batch_id` pinned, or None when nothing is pinned."""
        path = self._pins / f"{batch_id}.jsonl"
        try:
            return await asyncio.to_thread(_read_lines, path, self._run_limits(lines))
        except FileNotFoundError:
            return None

    async def unpin(self, batch_id: str) -> None:
        """Let go of a finished batch's input."""
        await asyncio.to_thread((self._pins / f"{batch_id}.jsonl").unlink, missing_ok=True)

    async def delete(self, tenant: str, file_id: str) -> FileRecord:
        """Delete the tenant's file (record and bytes)."""
        record = await self.get(tenant, file_id)
        await self._remove(record)
        return record

    async def list(self, tenant: str, *, purpose: str | None, after: str | None = None,
                   limit: int) -> list[FileRecord]:
        """The tenant's files, newest first, after the file `after` (expired ones excluded)."""
        now = self._wall()
        found = await self._store.files(tenant, purpose=purpose, after=after, limit=limit)
        return [r for r in found if r.expires_at > now]

    async def clean_expired(self) -> int:
        """Remove every expired file; how many there were."""
        expired = await self._store.expired_files(int(self._wall()))
        for record in expired:
            await self._remove(record)
        return len(expired)

    async def sweep(self, running: Iterable[str]) -> int:
        """At start: finish or undo what a crash left half done (a temporary file whose record committed
        becomes the file, any other goes), and drop pinned inputs of batches no longer `running`. How many
        files it removed."""
        known = await self._store.file_ids()
        return await asyncio.to_thread(_sweep, self._dir, self._pins, known, set(running))

    async def _remove(self, record: FileRecord) -> None:
        await self._store.delete_file(record.id)
        await asyncio.to_thread(self._path(record.id).unlink, missing_ok=True)

    def _run_limits(self, lines: int) -> LineLimits:
        # A stored file was checked at upload: limits lowered since then must not make it unreadable.
        return LineLimits(max(self._limits.max_lines, lines), max_line_bytes=1 << 62, max_depth=1 << 30,
                          max_messages=1 << 62)

    def _path(self, file_id: str, suffix: str = ".jsonl") -> Path:
        return self._dir / f"{file_id}{suffix}"


class Incoming:
    """Bytes arriving for one file, gathered and written to its temporary path by a worker thread."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path = path
        self.size = 0
        self.committing = False
        self._max = max_bytes
        self._pending = bytearray()
        self._file: IO[bytes] | None = None

    async def write(self, chunk: bytes) -> None:
        """Add `chunk`; 413 once the file passes its limit."""
        self.size += len(chunk)
        if self.size > self._max:
            raise too_large(self._max)
        self._pending += chunk
        if len(self._pending) >= WRITE_CHUNK_BYTES:
            data, self._pending = bytes(self._pending), bytearray()
            await asyncio.to_thread(self._write, data)

    def _write(self, data: bytes) -> None:
        if self._file is None:
            self._file = self.path.open("xb")
        self._file.write(data)

    def close(self) -> None:
        """Write what is still gathered and close the file (in a worker thread)."""
        data, self._pending = bytes(self._pending), bytearray()
        self._write(data)
        assert self._file is not None
        self._file.close()

    def discard(self, *, force: bool = False) -> None:
        """Close and remove the temporary file, if it is still there and no commit owns it (in a worker thread)."""
        if self._file is not None and not self._file.closed:
            self._file.close()
        if force or not self.committing:
            self.path.unlink(missing_ok=True)


class Outgoing:
    """An output or error file being written line by line; nothing is listed until `keep`."""

    def __init__(self, files: FileService, tenant: str, filename: str, path: Path) -> None:
        self.incoming = Incoming(path, max_bytes=1 << 62)  # the batch decides what fits (see `broker.bulk.finalize`)
        self._files, self._tenant, self._filename = files, tenant, filename
        self.lines = 0

    @property
    def size(self) -> int:
        """Bytes written so far."""
        return self.incoming.size

    async def write(self, data: bytes, lines: int) -> None:
        """Append `lines` lines."""
        self.lines += lines
        await self.incoming.write(data)

    async def keep(self) -> FileRecord:
        """Store the file: its record, then its bytes under its ID."""
        await asyncio.to_thread(self.incoming.close)
        return await self._files._keep(self.incoming, self._tenant, OUTPUT_PURPOSE, self._filename, self.lines)


def check_filename(name: str) -> str:
    """An upload's name as it is kept: printable text of valid UTF-8, cut at `MAX_FILENAME_CHARS`; 400 otherwise."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest("The file name is not valid UTF-8.", param="file", code="invalid_filename") from None
    if not name.isprintable():
        raise InvalidRequest("The file name holds control characters.", param="file", code="invalid_filename")
    return name[:MAX_FILENAME_CHARS] or "upload.jsonl"


def file_object(record: FileRecord) -> dict[str, Any]:
    """The OpenAI `file` object of a record."""
    return {"id": record.id, "object": "file", "bytes": record.bytes, "created_at": record.created_at,
            "expires_at": record.expires_at, "filename": record.filename, "purpose": record.purpose,
            "status": "processed", "status_details": None}


def too_large(limit: int) -> InvalidRequest:
    """The error for a file over the size limit."""
    return InvalidRequest(f"The file is larger than the limit of {limit} bytes.", param="file",
                          code="file_too_large", status=413)


def _count_lines(path: Path, limits: LineLimits) -> int:
    with path.open("rb", buffering=READ_BUFFER_BYTES) as stream:
        return count_batch_file(stream, limits)


def _read_lines(path: Path, limits: LineLimits) -> list[BatchLine]:
    with path.open("rb", buffering=READ_BUFFER_BYTES) as stream:
        return read_batch_file(stream, limits)


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except FileExistsError:
        pass  # pinned by an earlier attempt
    except OSError:  # a file system without hard links
        shutil.copyfile(source, target)


def _sweep(files: Path, pins: Path, known: set[str], running: set[str]) -> int:
    removed = 0
    for path in files.iterdir():
        if path.suffix == PARTIAL and path.stem in known:
            path.replace(path.with_suffix(".jsonl"))  # its record committed before the crash
        elif path.stem not in known or path.suffix not in (".jsonl", PARTIAL):
            path.unlink(missing_ok=True)
            removed += 1
    for path in pins.iterdir():
        if path.stem not in running:
            path.unlink(missing_ok=True)
            removed += 1
    return removed
