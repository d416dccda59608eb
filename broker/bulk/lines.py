"""Read and check a Batch API input file (JSONL), and write the output and error files' lines.

Pure. Each input line is `{"custom_id", "method": "POST", "url": "/v1/chat/completions", "body"}`; a
file is refused as a whole, naming the first bad line, when a line is not such an object, a `custom_id`
repeats, a URL is not supported, or the file is over its limits. Each line is held to what the live endpoint
accepts (`LineLimits`): its size, strict JSON (`mergebroker.jsonio.parse_strict`: UTF-8, no NaN or overflowing
numbers, no lone surrogates, bounded nesting) and the chat body's own checks, with its message count.
Lines are split on `\\n` only: a raw U+2028 inside a JSON string is text, not a line break. Files are read
from an open binary stream line by line, so a large one is never in memory as bytes. Output lines follow
OpenAI's batch output format: `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from mergebroker.broker.engine.ground.schemas import parse_chat
from mergebroker.errors import InvalidRequest
from mergebroker.jsonio import NotStrictJson, parse_strict

SUPPORTED_URLS = ("/v1/chat/completions",)
MAX_CUSTOM_ID_CHARS = 512


@dataclass(frozen=True)
class BatchLine:
    """One request of a batch file."""

    custom_id: str
    url: str
    body: dict[str, Any]  # what would be forwarded: the broker's own `broker` object removed
    mergeable: bool = True  # false when the line opted out with `broker.merge: false`


@dataclass(frozen=True)
class LineLimits:
    """What a batch file may hold: lines, and per line what a live request may (bytes, nesting, messages)."""

    max_lines: int
    max_line_bytes: int = 4 * 1024 * 1024
    max_depth: int = 64
    max_messages: int = 2048


def read_batch_file(stream: BinaryIO, limits: LineLimits) -> list[BatchLine]:
    """The file's requests, in order; `InvalidRequest` (param "file") naming the first problem."""
    return list(_checked(stream, limits))


def count_batch_file(stream: BinaryIO, limits: LineLimits) -> int:
    """Check every line of the file as `read_batch_file` does, keeping none; how many requests it holds."""
    return sum(1 for _ in _checked(stream, limits))


def parse_batch_file(raw: bytes, limits: LineLimits) -> list[BatchLine]:
    """`read_batch_file` of bytes already in memory."""
    return list(_checked_lines(_split(raw), limits))


def _checked(stream: BinaryIO, limits: LineLimits) -> Iterator[BatchLine]:
    return _checked_lines(_raw_lines(stream, limits.max_line_bytes), limits)


def _checked_lines(raws: Iterable[bytes | None], limits: LineLimits) -> Iterator[BatchLine]:
    seen: set[str] = set()
    count = 0
    for number, raw in enumerate(raws, start=1):
        if raw is None:
            raise _bad(f"Line {number} is longer than {limits.max_line_bytes} bytes, the most one request may "
                       "hold.", code="line_too_large")
        if not raw.strip():
            continue
        if count >= limits.max_lines:
            raise _bad(f"The file has more than {limits.max_lines} requests.", code="too_many_requests")
        parsed = _parse_line(raw, number, limits)
        if parsed.custom_id in seen:
            raise _bad(f"Line {number}: custom_id {parsed.custom_id!r} appears more than once; each request "
                       "needs a unique custom_id.", code="duplicate_custom_id")
        seen.add(parsed.custom_id)
        count += 1
        yield parsed
    if not count:
        raise _bad("The file holds no requests.", code="empty_file")


def _raw_lines(stream: BinaryIO, max_bytes: int) -> Iterator[bytes | None]:
    """The stream's lines split on b"\\n" only; None for a line longer than `max_bytes` (then it stops)."""
    while True:
        raw = stream.readline(max_bytes + 2)  # room for the line break (and a "\r" before it)
        if not raw:
            return
        if len(raw) > max_bytes and not (raw.endswith(b"\n") and len(raw.rstrip(b"\r\n")) <= max_bytes):
            yield None
            return
        yield raw


def _split(raw: bytes) -> Iterator[bytes]:
    return iter(raw.split(b"\n"))


def _parse_line(raw: bytes, number: int, limits: LineLimits) -> BatchLine:
    try:
        data = parse_strict(raw, limits.max_depth)
    except NotStrictJson as exc:
        raise _bad(f"Line {number} {exc}.", code="invalid_json") from None
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
        parsed, forward = parse_chat(body, max_messages=limits.max_messages)  # the same checks as a live request
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
        found = body.get("error")
        inner: dict[str, Any] = found if isinstance(found, dict) else {}
        error = {"code": inner.get("code") or inner.get("type"), "message": inner.get("message")}
    return {"id": "batch_req_" + secrets.token_hex(12), "custom_id": custom_id,
            "response": {"status_code": status, "request_id": "req_" + secrets.token_hex(12), "body": body},
            "error": error}


def error_line(custom_id: str, code: str, message: str) -> dict[str, Any]:
    """One line of an error file for a request that got no response (unsent, or its answer could not be kept)."""
    return {"id": "batch_req_" + secrets.token_hex(12), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def output_line_bytes(custom_id: str, status: int, body_json: str) -> bytes:
    """`output_line` as a JSONL line, from a body already in JSON text (as the store keeps it): no re-encoding."""
    error = "null"
    if status >= 300:
        error = json.dumps(output_line(custom_id, status, json.loads(body_json))["error"], separators=(",", ":"))
    # %-formatting: the template is JSON text, whose braces an f-string would have to double.
    return ('{"id":"batch_req_%s","custom_id":%s,"response":{"status_code":%d,"request_id":"req_%s","body":%s},'  # noqa: UP031
            '"error":%s}\n' % (secrets.token_hex(12), json.dumps(custom_id), status, secrets.token_hex(12),
                               body_json, error)).encode()


def jsonl(rows: Iterable[dict[str, Any]]) -> bytes:
    """Rows as JSON lines."""
    return b"".join(json.dumps(row, separators=(",", ":")).encode() + b"\n" for row in rows)
