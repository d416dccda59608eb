"""`/v1/files` for the Batch API: files on disk, their records in the batch store, one owner each.

A tenant sees only its own files: another tenant's file ID is answered exactly like an unknown one (404),
so IDs reveal nothing. Batch input files are checked in full at upload (`broker.bulk.lines`); output and
error files are written by the batch runner. Every file expires `file_ttl_s` after it was created and
`clean_expired` removes it (record and bytes). Disk work runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from pathlib import Path
from typing import Any, Callable

from mergebroker.broker.bulk.lines import BatchLine, parse_batch_file
from mergebroker.broker.bulk.store import BatchStore, FileRecord
from mergebroker.errors import InvalidRequest, NotFound

BATCH_PURPOSE = "batch"
OUTPUT_PURPOSE = "batch_output"


class FileService:
    """Stores, checks, lists and expires a tenant's files."""

    def __init__(self, directory: Path, store: BatchStore, *, max_bytes: int, max_lines: int, ttl_s: float,
                 wall: Callable[[], float] = time.time) -> None:
        self._dir = directory / "files"
        self._dir.mkdir(parents=True, exist_ok=True)
        self._store = store
        self.max_bytes = max_bytes
        self._max_lines = max_lines
        self._ttl_s = ttl_s
        self._wall = wall

    async def upload(self, tenant: str, purpose: str, filename: str, data: bytes) -> FileRecord:
        """Store an uploaded batch input file after checking every line."""
        if purpose != BATCH_PURPOSE:
            raise InvalidRequest(f"Unsupported purpose {purpose!r}: this broker stores files for 'batch' only.",
                                 param="purpose", code="invalid_purpose")
        lines = await asyncio.to_thread(parse_batch_file, data, max_lines=self._max_lines)
        return await self._save(tenant, purpose, filename, data, len(lines))

    async def save_output(self, tenant: str, filename: str, data: bytes, lines: int) -> FileRecord:
        """Store an output or error file written for a batch."""
        return await self._save(tenant, OUTPUT_PURPOSE, filename, data, lines)

    async def _save(self, tenant: str, purpose: str, filename: str, data: bytes, lines: int) -> FileRecord:
        if len(data) > self.max_bytes:
            raise too_large(self.max_bytes)
        now = int(self._wall())
        record = FileRecord("file-" + secrets.token_hex(12), tenant, purpose, filename[:255] or "upload.jsonl",
                            len(data), now, now + int(self._ttl_s), lines)
        await asyncio.to_thread(_write_atomically, self._path(record.id), data)
        await self._store.add_file(record)
        return record

    async def get(self, tenant: str, file_id: str) -> FileRecord:
        """The tenant's file, or 404 (for another tenant's file too)."""
        record = await self._store.file(file_id)
        if record is None or record.tenant != tenant or record.expires_at <= self._wall():
            raise NotFound(f"No such File object: {file_id}", param="file_id", code="file_not_found")
        return record

    async def content(self, tenant: str, file_id: str) -> bytes:
        """The bytes of the tenant's file."""
        record = await self.get(tenant, file_id)
        return await asyncio.to_thread(self._path(record.id).read_bytes)

    async def batch_lines(self, record: FileRecord) -> list[BatchLine]:
        """The requests of a stored batch input file (checked again, as the runner reads it)."""
        data = await asyncio.to_thread(self._path(record.id).read_bytes)
        return await asyncio.to_thread(parse_batch_file, data, max_lines=max(self._max_lines, record.lines))

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

    async def _remove(self, record: FileRecord) -> None:
        await self._store.delete_file(record.id)
        await asyncio.to_thread(self._path(record.id).unlink, missing_ok=True)

    def _path(self, file_id: str) -> Path:
        return self._dir / f"{file_id}.jsonl"


def file_object(record: FileRecord) -> dict[str, Any]:
    """The OpenAI `file` object of a record."""
    return {"id": record.id, "object": "file", "bytes": record.bytes, "created_at": record.created_at,
            "expires_at": record.expires_at, "filename": record.filename, "purpose": record.purpose,
            "status": "processed", "status_details": None}


def too_large(limit: int) -> InvalidRequest:
    """The error for a file over the size limit."""
    return InvalidRequest(f"The file is larger than the limit of {limit} bytes.", param="file",
                          code="file_too_large", status=413)


def _write_atomically(path: Path, data: bytes) -> None:
    # Written beside, then renamed: a crash never leaves a half-written file under a live ID.
    partial = path.with_suffix(".partial")
    partial.write_bytes(data)
    partial.replace(path)
