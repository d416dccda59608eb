"""A finished batch's output and error files, written page by page from the stored results.

Every `custom_id` appears exactly once across the two files: a line answered 2xx goes to the output file, any
other answer to the error file, and a line never answered to the error file with why (the batch was
cancelled, expired or failed first). The output file holds at most `max_output_bytes`: an answer that would
pass it goes to the error file as `output_too_large` (its answer stays in the store), and the batch is told
so it can fail with that reason rather than stick. When the input's lines cannot be read back, the stored
answers are still written and the lines nobody can name are counted as `lost`. Results are read a page at a
time and rendered in a worker thread, so a batch of fifty thousand lines neither fills memory nor stalls
the event loop; nothing is listed until both files are complete.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from mergebroker.broker.bulk.files import FileService
from mergebroker.broker.bulk.lines import error_line, jsonl, output_line_bytes
from mergebroker.broker.bulk.store import BatchStore, FileRecord

PAGE_ROWS = 1000
UNSENT = {"cancelled": ("batch_cancelled", "The batch was cancelled before this request was sent."),
          "expired": ("batch_expired", "The batch's completion window ended before this request was sent."),
          "failed": ("batch_failed", "The batch failed before this request was answered.")}
OUTPUT_TOO_LARGE = ("output_too_large", "This request was answered, but its answer would have made the output "
                    "file larger than its limit; it is not in the output file.")


@dataclass(frozen=True)
class Written:
    """What the files hold: their records (None when empty) and the lines counted each way."""

    output: FileRecord | None
    errors: FileRecord | None
    completed: int
    failed: int
    overflow: int  # answered lines the output file had no room for
    lost: int  # lines of the input that could not be read back, so no file names them


@dataclass(frozen=True)
class _Page:
    good: bytes
    good_lines: int
    bad: bytes
    bad_lines: int
    overflow: int
    seen: list[str]


async def write_files(store: BatchStore, files: FileService, *, batch_id: str, tenant: str,
                      custom_ids: Sequence[str] | None, total: int, status: str, max_output_bytes: int) -> Written:
    """Write the batch's output and error files (`custom_ids`: its input's lines, None when unreadable)."""
    seen: set[str] = set()
    overflow = 0
    async with (files.output(tenant, f"{batch_id}_output.jsonl") as out,
                files.output(tenant, f"{batch_id}_error.jsonl") as err):
        after = 0
        while rows := await store.result_page(batch_id, after=after, limit=PAGE_ROWS):
            after = rows[-1][0]
            page = await asyncio.to_thread(_render, rows, seen, max_output_bytes - out.size)
            seen.update(page.seen)
            overflow += page.overflow
            await out.write(page.good, page.good_lines)
            await err.write(page.bad, page.bad_lines)
        lost = 0
        if custom_ids is None:
            lost = max(0, total - len(seen))
        else:
            code, message = UNSENT[status if status in UNSENT else "failed"]
            unsent = await asyncio.to_thread(_unsent, custom_ids, seen, code, message)
            await err.write(unsent, unsent.count(b"\n"))
        completed = out.lines
        output = await out.keep() if out.lines else None
        errors = await err.keep() if err.lines else None
    return Written(output, errors, completed, err.lines + lost, overflow, lost)


def _render(rows: list[tuple[int, str, int, str]], seen: set[str], room: int) -> _Page:
    """One page of results as output and error lines; answers past `room` bytes become `output_too_large`."""
    good: list[bytes] = []
    bad: list[bytes] = []
    used = overflow = 0
    fresh: list[str] = []
    for _, custom_id, status, body in rows:
        if custom_id in seen:
            continue
        fresh.append(custom_id)
        line = output_line_bytes(custom_id, status, body)
        if status >= 300:
            bad.append(line)
        elif used + len(line) <= room:
            good.append(line)
            used += len(line)
        else:
            overflow += 1
            bad.append(jsonl([error_line(custom_id, *OUTPUT_TOO_LARGE)]))
    return _Page(b"".join(good), len(good), b"".join(bad), len(bad), overflow, fresh)


def _unsent(custom_ids: Sequence[str], seen: set[str], code: str, message: str) -> bytes:
    return jsonl(error_line(c, code, message) for c in custom_ids if c not in seen)
