"""Reading a `/v1/files` upload: a multipart body, inflated and bounded as it streams, its file part to disk.

The body is read through `BodyStream`, which gives aiohttp's multipart parser the few `StreamReader` methods
it uses while applying every limit in one place: each read waits at most `idle_s` (a slow but moving upload
is fine, a silent one is cut off), the bytes received and the bytes inflated are capped (a small gzip bomb
stops at the cap), and `Content-Encoding` is read as the README says for every body: gzip and deflate are
inflated, identity is read as is, anything else is 415. The form may hold at most `max_parts` parts
(`batches.max_form_parts`, 8 by default; OpenAI's has two: `purpose` and `file`), so a body of forty thousand
tiny fields is refused at the ninth; the
small fields are strict UTF-8 of at most `MAX_FIELD_BYTES`. The file part goes straight to the upload's
temporary file (`broker.bulk.files.Incoming`), never whole into memory.
"""

from __future__ import annotations

import asyncio
import zlib
from dataclasses import dataclass, field

from aiohttp import BodyPartReader, ClientPayloadError, MultipartReader, StreamReader, web
from aiohttp.http_exceptions import HttpProcessingError

from mergebroker.broker.bulk.files import Incoming, too_large
from mergebroker.errors import InvalidRequest, RequestTimeout, UnsupportedMediaType

MAX_FIELD_BYTES = 1024
MAX_LINE_BYTES = 64 * 1024
"""Longest boundary or header line the multipart parser may ask for (a line without an end is refused)."""
FORM_OVERHEAD_BYTES = 64 * 1024
"""Room for the multipart boundaries and small fields around a file of the largest size allowed."""
CHUNK_BYTES = 1 << 16
_INFLATE_STEP = 1 << 18  # inflated bytes produced per step: a bomb never expands in one go
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


@dataclass
class Form:
    """What an upload's form held: its small fields, the file part's name, whether there was a file part."""

    fields: dict[str, str] = field(default_factory=dict)
    filename: str = "upload.jsonl"
    has_file: bool = False


def body_encoding(request: web.Request) -> str:
    """The request's `Content-Encoding`, normalised; 415 when it is neither none, gzip nor deflate."""
    name = request.headers.get("Content-Encoding", "").strip().lower()
    if name in ("", "identity"):
        return ""
    if name not in _WBITS:
        raise UnsupportedMediaType(f"Content-Encoding '{name[:40]}' is not supported; use gzip, deflate or none.",
                                   code="unsupported_content_encoding")
    return name


async def read_form(request: web.Request, incoming: Incoming, *, encoding: str, max_bytes: int, max_parts: int,
                    idle_s: float) -> Form:
    """Read the upload's form, the file part into `incoming`; 400 for a body that is not such a form."""
    stream = BodyStream(request.content, encoding, max_bytes=max_bytes, idle_s=idle_s)
    form = Form()
    try:
        reader = MultipartReader(request.headers, stream)  # type: ignore[arg-type]  # the methods it uses
        parts = 0
        while (part := await reader.next()) is not None:
            parts += 1
            if parts > max_parts:
                raise InvalidRequest(f"The form holds more than {max_parts} parts; send 'purpose' and 'file'.",
                                     code="too_many_fields")
            if not isinstance(part, BodyPartReader):
                raise InvalidRequest("Nested multipart bodies are not accepted.", code="invalid_multipart")
            await _read_part(part, form, incoming)
    except (ValueError, AssertionError, RuntimeError, ClientPayloadError, HttpProcessingError) as exc:
        raise InvalidRequest("The body is not valid multipart/form-data.", code="invalid_multipart") from exc
    return form


async def _read_part(part: BodyPartReader, form: Form, incoming: Incoming) -> None:
    if part.name == "file":
        if form.has_file:
            raise InvalidRequest("The form holds more than one 'file' part.", param="file", code="invalid_multipart")
        form.has_file = True
        form.filename = part.filename or form.filename
        while chunk := await part.read_chunk(CHUNK_BYTES):
            await incoming.write(chunk)
        return
    value = bytearray()
    while chunk := await part.read_chunk(CHUNK_BYTES):
        value += chunk
        if len(value) > MAX_FIELD_BYTES:
            raise InvalidRequest(f"The form field {str(part.name)[:40]!r} is longer than {MAX_FIELD_BYTES} bytes.",
                                 param=part.name, code="invalid_multipart")
    if part.name:
        try:
            form.fields[part.name] = value.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequest(f"The form field {part.name[:40]!r} is not UTF-8 text.", param=part.name,
                                 code="invalid_multipart") from None


class BodyStream:
    """The request body as aiohttp's multipart parser reads it (`read`, `readline`, `at_eof`, `unread_data`),
    inflated when encoded, each wait bounded by `idle_s`, at most `max_bytes` received or inflated."""

    def __init__(self, source: StreamReader, encoding: str, *, max_bytes: int, idle_s: float) -> None:
        self._source = source
        self._encoding = encoding
        self._inflater: zlib._Decompress | None = None
        self._max = max_bytes
        self._idle_s = idle_s
        self._received = 0
        self._produced = 0
        self._buffer = bytearray()
        self._tail = b""  # compressed bytes not yet inflated
        self._source_done = False

    def at_eof(self) -> bool:
        """No byte left to read."""
        return self._source_done and not self._tail and not self._buffer

    def unread_data(self, data: bytes) -> None:
        """Put `data` back in front (the parser looks ahead for boundaries)."""
        self._buffer[:0] = data

    async def read(self, n: int = -1) -> bytes:
        """Up to `n` bytes (everything when `n` < 0); b"" at the end."""
        if n < 0:
            while await self._fill():
                pass
            n = len(self._buffer)
        elif not self._buffer:
            await self._fill()
        out = bytes(self._buffer[:n])
        del self._buffer[:n]
        return out

    async def readline(self, *, max_line_length: int | None = None) -> bytes:
        """The next line with its b"\\n" (or what is left at the end); 400 past `max_line_length`."""
        most = max_line_length or MAX_LINE_BYTES
        start = 0
        while (end := self._buffer.find(b"\n", start)) < 0:
            start = len(self._buffer)
            if start > most:
                raise ValueError("a multipart line is too long")
            if not await self._fill():
                end = len(self._buffer) - 1
                break
        out = bytes(self._buffer[:end + 1])
        del self._buffer[:end + 1]
        return out

    async def _fill(self) -> bool:
        """Add some bytes to the buffer; False at the end of the body."""
        while True:
            if self._tail:
                out = self._inflate(self._tail)
                if out:  # a step may inflate to nothing (a header): b"" would read as the end
                    self._produce(out)
                    return True
                continue
            if self._source_done:
                return False
            try:
                async with asyncio.timeout(self._idle_s):
                    raw = await self._source.readany()
            except TimeoutError:
                raise RequestTimeout("The upload stalled: no data for too long.") from None
            if not raw:
                self._finish()
                continue
            self._received += len(raw)
            if self._received > self._max:
                raise too_large(self._max)
            if not self._encoding:
                self._produce(raw)
                return True
            self._tail = raw

    def _inflate(self, raw: bytes) -> bytes:
        if self._inflater is None:
            wbits = _WBITS[self._encoding]
            if self._encoding == "deflate" and (raw[0] & 0x0F) != 8:
                wbits = -zlib.MAX_WBITS  # raw deflate without the zlib header, as some clients send it
            self._inflater = zlib.decompressobj(wbits)
        try:
            out = self._inflater.decompress(raw, _INFLATE_STEP)
        except zlib.error:
            raise InvalidRequest(f"The request body is not valid {self._encoding} data.",
                                 code="invalid_encoding") from None
        self._tail = self._inflater.unconsumed_tail
        return out

    def _produce(self, data: bytes) -> None:
        self._produced += len(data)
        if self._produced > self._max:
            raise too_large(self._max)
        self._buffer += data

    def _finish(self) -> None:
        self._source_done = True
        if self._encoding and (self._inflater is None or not self._inflater.eof):
            raise InvalidRequest(f"The request body is truncated {self._encoding} data.", code="invalid_encoding")
