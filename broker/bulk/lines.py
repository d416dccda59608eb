"""Read and check a Batch API input file (JSONL), and write the output and error files' lines.

Pure. Each input line is `{"custom_id", "method": "POST", "url": "/v1/chat/completions", "body"}`; a
file is refused as a whole, naming the first bad line, when a line is not such an object, a `custom_id`
repeats, a URL is not supported, or the file is over its limits. Output lines follow OpenAI's batch
output format: `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any, Iterable

from mergebroker.broker.engine.schemas import parse_chat
from mergebroker.errors import InvalidRequest

SUPPORTED_URLS = ("/v1/chat/completions",)
MAX_CUSTOM_ID_CHARS = 512


@dataclass(frozen=True)
class BatchLine:
    """One request of a batch file."""

    custom_id: str
    url: str
    body: dict[str, Any]  # what would be forwarded: the broker's own `broker` object removed
    mergeable: bool = True  # false when the line opted out with `broker.merge: false`


def parse_batch_file(raw: bytes, *, max_lines: int) -> list[BatchLine]:
    """The file's requests, in order; `InvalidRequest` (param "file") naming the first problem."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _bad("The file is not UTF-8 text.") from None
    lines: list[BatchLine] = []
    seen: set[str] = set()
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if len(lines) >= max_lines:
            raise _bad(f"The file has more than {max_lines} requests.", code="too_many_requests")
        parsed = _parse_line(line, number)
        if parsed.custom_id in seen:
            raise _bad(f"Line {number}: custom_id {parsed.custom_id!r} appears more than once; each request "
                       "needs a unique custom_id.", code="duplicate_custom_id")
        seen.add(parsed.custom_id)
        lines.append(parsed)
    if not lines:
        raise _bad("The file holds no requests.", code="empty_file")
    return lines


def _parse_line(line: str, number: int) -> BatchLine:
    try:
        data = json.loads(line)
    except (ValueError, RecursionError):
        raise _bad(f"Line {number} is not valid JSON.") from None
    if not isinstance(data, dict):
        raise _bad(f"Line {number} must be a JSON object.")
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID_CHARS:
        raise _bad(f"Line {number}: 'custom_id' must be a non-empty string of at most {MAX_CUSTOM_ID_CHARS} "
                   "characters.")
    if data.get("method") != "POST":
        raise _bad(f"Line {number}: 'method' must be 'POST'.")
    url = data.get("url")
    if url not in SUPPORTED_URLS:
        raise _bad(f"Line {number}: url {url!r} is not supported; use one of {', '.join(SUPPORTED_URLS)}.",
                   code="unsupported_url")
    body = data.get("body")
    if not isinstance(body, dict):
        raise _bad(f"Line {number}: 'body' must be a JSON object.")
    try:
        parsed, forward = parse_chat(body)  # the same checks as a live request
    except InvalidRequest as exc:
        raise _bad(f"Line {number}: {exc.message}") from None
    if parsed.stream:
        raise _bad(f"Line {number}: streaming is not supported in a batch.")
    return BatchLine(custom_id, url, forward, mergeable=not (parsed.broker and parsed.broker.merge is False))


def _bad(message: str, *, code: str = "invalid_batch_file") -> InvalidRequest:
    return InvalidRequest(message, param="file", code=code)


def output_line(custom_id: str, status: int, body: dict[str, Any]) -> dict[str, Any]:
    """One line of an output file (2xx) or error file (anything else) in OpenAI's batch output format."""
    error = None
    if status >= 300:
        inner = body.get("error") if isinstance(body.get("error"), dict) else {}
        error = {"code": inner.get("code") or inner.get("type"), "message": inner.get("message")}
    return {"id": "batch_req_" + secrets.token_hex(12), "custom_id": custom_id,
            "response": {"status_code": status, "request_id": "req_" + secrets.token_hex(12), "body": body},
            "error": error}


def jsonl(rows: Iterable[dict[str, Any]]) -> bytes:
    """Rows as JSON lines."""
    return b"".join(json.dumps(row, separators=(",", ":")).encode() + b"\n" for row in rows)
