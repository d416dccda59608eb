"""A lean HTTP/1.1 client for the upstreams: keep-alive connections on asyncio protocols, answers read by
llhttp (`httptools`).

Why not aiohttp's `ClientSession`: each of its calls builds a request object, a response object, a stream
reader, timers and trace hooks, about 3,300 Python bytecodes per call, as much as all of the broker's own
work on a request (`python -m bench bytecodes`). A call here writes one buffer, lets the C parser fill one
answer, and wakes its caller once (`request`). A stream (`open_stream`) hands its caller the head as soon as
it is in, then the body's pieces as they come, pausing the socket while too much waits unread.

The errors are Python's own: `TimeoutError` once the call's time is up (for a stream: a gap between pieces
longer than its read timeout), `OSError`s when connecting fails or the connection drops before the answer
is whole (`ConnectionResetError`), `MalformedAnswer` when the bytes are not HTTP.
`providers.openai.wire.translated_errors` maps them like aiohttp's.

No cookies are kept and no proxy is used, as with the session before it: a cookie one upstream sets must
never travel with another tenant's call.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import zlib
from collections.abc import AsyncIterator, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

import httptools
from multidict import CIMultiDict

_USER_AGENT = "mergebroker"
_ENCODINGS = "gzip, deflate"
_UNSAFE = frozenset("\r\n\0")
_PAUSE_AT = 256 * 1024  # bytes of a stream's body waiting unread before its socket stops being read
_RESUME_AT = 64 * 1024


class MalformedAnswer(Exception):
    """The upstream's bytes are not a well-formed HTTP/1.1 answer."""


class InvalidUpstreamURL(OSError):
    """A URL this client can never reach: not http(s), or without a host."""


class _Unanswered(ConnectionResetError):
    """The connection closed before a single byte of the answer came back."""


@dataclass(frozen=True, slots=True)
class Answer:
    """One whole HTTP answer: its status, its head as received (status line and headers) and its decoded body."""

    status: int
    head: bytes
    body: bytes

    @property
    def headers(self) -> CIMultiDict[str]:
        """The headers, case-insensitive (read from the head only when asked: most answers never are)."""
        return CIMultiDict(_header_fields(self.head))


class _Connection(asyncio.Protocol):
    """One keep-alive connection; answers one call at a time (no pipelining)."""

    def __init__(self, pool: Http1Pool) -> None:
        self._pool = pool
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._parser: httptools.HttpResponseParser | None = None
        self._waiter: asyncio.Future[Any] | None = None  # its `Answer`, or its stream once the head is in
        self._head = b""  # what came before the headers were complete (the head, perhaps some body)
        self._body: list[bytes] = []
        self._headers_done = False
        self._heard = False  # any byte of the current answer
        self.reusable = False
        self.counted = True  # holds one of the pool's places until `Http1Pool.forget`
        self._stream: StreamedAnswer | None = None  # the answer being streamed, once its head is in

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, data: bytes, waiter: asyncio.Future[Any], stream: StreamedAnswer | None = None) -> None:
        """Write one request; `waiter` gets its whole `Answer`, or `stream` once the head is in (`stream` then
        gets the body)."""
        self._parser = httptools.HttpResponseParser(self)
        self._waiter, self._head, self._body, self._stream = waiter, b"", [], stream
        self._headers_done = self._heard = self.reusable = False
        self.transport.write(data)  # type: ignore[union-attr]

    def data_received(self, data: bytes) -> None:
        if self._parser is None:  # bytes nobody asked for: this connection cannot be trusted any more
            self.abort()
            return
        self._heard = True
        if not self._headers_done:
            self._head += data
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(MalformedAnswer(f"malformed HTTP answer: {exc}"))
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool.forget(self)
        if self._stream is not None and self._headers_done:
            if self._delimited():
                self._stream.fail(ConnectionResetError("the upstream closed the connection before its answer ended"))
            else:
                self._stream.end()  # an answer without a length ends with its connection
            return
        if self._waiter is None or self._waiter.done():
            return
        if self._headers_done and not self._delimited():
            self._finish()  # an answer without a length ends with its connection
        elif not self._heard:
            self._fail(_Unanswered("the upstream closed the connection without answering"))
        else:
            self._fail(ConnectionResetError("the upstream closed the connection before its answer ended"))

    def abort(self) -> None:
        """Close at once: the connection is mid-answer or untrusted, never to be reused."""
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    # llhttp's callbacks, called from `feed_data` (no `on_header`: the head is kept whole and read when needed)
    def on_headers_complete(self) -> None:
        self._headers_done = True
        stream, waiter = self._stream, self._waiter
        if stream is None or waiter is None:
            return
        status = self._parser.get_status_code()  # type: ignore[union-attr]
        if status >= 200 or status == 101:  # not an interim answer (`on_message_complete`): the stream begins
            self._waiter = None
            stream.begin(status, self._head.split(b"\r\n\r\n", 1)[0])
            if not waiter.done():
                waiter.set_result(stream)

    def on_body(self, body: bytes) -> None:
        if self._stream is not None:
            self._stream.feed(body)
        else:
            self._body.append(body)

    def on_message_complete(self) -> None:
        status = self._parser.get_status_code()  # type: ignore[union-attr]
        if status < 200 and status != 101:
            # An interim answer (100 Continue, 103 Early Hints): the real one follows on the same connection.
            self._head = self._head.split(b"\r\n\r\n", 1)[-1]
            self._headers_done = False
            return
        self.reusable = self._parser.should_keep_alive()  # type: ignore[union-attr]
        if self._stream is not None:
            stream, self._parser, self._stream = self._stream, None, None
            stream.end()
        else:
            self._finish()

    def pause(self, paused: bool) -> None:
        """Stop (or go back to) reading the socket while a stream's reader lags behind."""
        if self.transport is not None and not self.closed:
            if paused:
                self.transport.pause_reading()
            else:
                self.transport.resume_reading()

    def _finish(self) -> None:
        parser, waiter = self._parser, self._waiter
        self._parser = self._waiter = None
        if waiter is None or waiter.done():
            return
        head = self._head.split(b"\r\n\r\n", 1)[0]
        try:
            body = _decoded(b"".join(self._body), head)
        except zlib.error as exc:
            waiter.set_exception(MalformedAnswer(f"undecodable body: {exc}"))
            return
        waiter.set_result(Answer(parser.get_status_code(), head, body))  # type: ignore[union-attr]

    def _fail(self, exc: Exception) -> None:
        waiter, self._parser, self._waiter = self._waiter, None, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        elif self._stream is not None:
            self._stream.fail(exc)

    def _delimited(self) -> bool:
        """Whether the answer said where it ends (a length or chunks), so a close before then is a cut."""
        head = self._head.lower()
        return b"\ncontent-length:" in head or b"\ntransfer-encoding:" in head


class StreamedAnswer:
    """An answer read as it comes: `status` and `headers` at once, the body's pieces from `chunks()` (or all of
    it from `read()`), each wait for the next piece at most `read_timeout` seconds. `close()` when done: a
    connection whose answer was read to its end goes back to the pool, one left mid-answer is closed."""

    def __init__(self, pool: Http1Pool, conn: _Connection, loop: asyncio.AbstractEventLoop,
                 read_timeout: float) -> None:
        self.status = 0
        self.head = b""
        self._pool, self._conn, self._loop, self._read_timeout = pool, conn, loop, read_timeout
        self._pieces: collections.deque[bytes] = collections.deque()
        self._unread = 0
        self._paused = False
        self._ended = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._decoder: Any = None
        self._closed = False

    @property
    def headers(self) -> CIMultiDict[str]:
        """The headers, case-insensitive."""
        return CIMultiDict(_header_fields(self.head))

    @property
    def content_type(self) -> str:
        """The media type, lowercased, without parameters ("" when none)."""
        return self.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's pieces as they arrive."""
        while True:
            if self._pieces:
                piece = self._pieces.popleft()
                self._unread -= len(piece)
                if self._paused and self._unread <= _RESUME_AT:
                    self._paused = False
                    self._conn.pause(False)
                yield piece
            elif self._error is not None:
                raise self._error
            elif self._ended:
                return
            else:
                await self._next_piece()

    async def read(self) -> bytes:
        """The rest of the body, whole."""
        return b"".join([piece async for piece in self.chunks()])

    def close(self) -> None:
        """Done with the answer: its connection goes back to the pool if read to its end, else is closed."""
        if self._closed:
            return
        self._closed = True
        if self._ended and not self._pieces and self._error is None:
            self._pool.put_back(self._conn)
        else:
            self._conn.abort()

    # called by the connection
    def begin(self, status: int, head: bytes) -> None:
        self.status, self.head = status, head
        if b"content-encoding" in head.lower():
            coding = self.headers.get("Content-Encoding", "").strip().lower()
            if coding in ("gzip", "x-gzip", "deflate"):
                self._decoder = zlib.decompressobj(32 + zlib.MAX_WBITS)  # gzip or zlib, told apart by their header

    def feed(self, data: bytes) -> None:
        if self._decoder is not None:
            try:
                data = self._decoder.decompress(data)
            except zlib.error as exc:
                self.fail(MalformedAnswer(f"undecodable body: {exc}"))
                self._conn.abort()
                return
        if data:
            self._pieces.append(data)
            self._unread += len(data)
            if not self._paused and self._unread > _PAUSE_AT:
                self._paused = True
                self._conn.pause(True)
            self._wake()

    def end(self) -> None:
        if self._decoder is not None:
            rest = self._decoder.flush()
            if rest:
                self._pieces.append(rest)
        self._ended = True
        self._wake()

    def fail(self, exc: BaseException) -> None:
        if not self._ended and self._error is None:
            self._error = exc
            self._wake()

    async def _next_piece(self) -> None:
        waiter = self._waiter = self._loop.create_future()
        timer = self._loop.call_at(self._loop.time() + self._read_timeout, _expire, waiter,
                                   "the upstream sent nothing within the read timeout")
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


def _header_fields(head: bytes) -> list[tuple[str, str]]:
    """The (name, value) pairs of a head as received (its first line is the status line)."""
    fields = []
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        fields.append((name.strip().decode("latin-1"), value.strip().decode("latin-1")))
    return fields


def _decoded(body: bytes, head: bytes) -> bytes:
    """`body` decompressed as its Content-Encoding says (gzip or deflate, the two asked for)."""
    if not body or b"content-encoding" not in head.lower():
        return body
    for name, value in _header_fields(head):
        if name.lower() == "content-encoding":
            coding = value.lower()
            if coding in ("gzip", "x-gzip"):
                return zlib.decompress(body, 16 + zlib.MAX_WBITS)
            if coding == "deflate":  # zlib-wrapped as the RFC says, or raw as some servers send it
                try:
                    return zlib.decompress(body)
                except zlib.error:
                    return zlib.decompress(body, -zlib.MAX_WBITS)
    return body


class Http1Pool:
    """Keep-alive connections to one origin (`scheme://host:port`), at most `max_connections` at once.

    An idle connection is reused newest first, and dropped once idle for `keepalive_timeout_s` or closed by
    the upstream. `headers` go with every call (credentials: they are never logged).
    """

    def __init__(self, scheme: str, host: str, port: int, *, headers: Mapping[str, str], max_connections: int,
                 keepalive_timeout_s: float, connect_timeout_s: float) -> None:
        self._host, self._port = host, port
        self._ssl: ssl.SSLContext | None = ssl.create_default_context() if scheme == "https" else None
        default_port = 443 if scheme == "https" else 80
        authority = host if port == default_port else f"{host}:{port}"
        if ":" in host and not host.startswith("["):  # an IPv6 literal
            authority = f"[{host}]" if port == default_port else f"[{host}]:{port}"
        fixed = {"Host": authority, "User-Agent": _USER_AGENT, "Accept": "*/*", "Accept-Encoding": _ENCODINGS,
                 **headers}
        self._fixed = "".join(_header_line(k, v) for k, v in fixed.items())
        self._max = max_connections
        self._keepalive_s = keepalive_timeout_s
        self._connect_s = connect_timeout_s
        self._idle: collections.deque[_Connection] = collections.deque()
        self._open = 0
        self._room_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._closed = False

    def request(self, method: str, target: str, body: bytes | None, headers: Mapping[str, str] | None,
                timeout: float) -> Coroutine[Any, Any, Answer]:
        """Send one request (`target`: path and query) and read its whole answer within `timeout` seconds, to
        await (the coroutine of `_send`: one awaiting layer fewer on every call)."""
        return self._send(self._request_bytes(method, target, body, headers), timeout, stream=False)

    def open_stream(self, method: str, target: str, body: bytes | None, headers: Mapping[str, str] | None,
                    read_timeout: float) -> Coroutine[Any, Any, StreamedAnswer]:
        """Send one request and return its answer once the head is in, to await. Connecting, the head, and each
        later wait for the body take at most `read_timeout` seconds each: a long answer that keeps flowing is
        never cut. The caller `close()`s the answer."""
        return self._send(self._request_bytes(method, target, body, headers), read_timeout, stream=True)

    async def _send(self, data: bytes, timeout: float, *, stream: bool) -> Any:
        """`data` sent on an idle connection or a new one; its whole `Answer`, or its `StreamedAnswer`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        read_timeout = timeout if stream else None
        conn = self._reuse(loop.time())
        if conn is not None:
            try:
                return await self._exchange(loop, conn, data, deadline, read_timeout)
            except _Unanswered:
                # Closed by the upstream as it went idle, just as this call went out (the keep-alive race):
                # the request was never read, so it goes once more on a fresh connection.
                pass
        conn = await self._connect(loop, deadline)
        if stream:
            deadline = loop.time() + timeout  # a stream's wait for its head starts once connected
        return await self._exchange(loop, conn, data, deadline, read_timeout)

    def _request_bytes(self, method: str, target: str, body: bytes | None,
                       headers: Mapping[str, str] | None) -> bytes:
        head = f"{method} {target} HTTP/1.1\r\n{self._fixed}"
        if headers:
            head += "".join(_header_line(k, v) for k, v in headers.items())
        data = (head + f"Content-Length: {len(body) if body is not None else 0}\r\n\r\n").encode()
        return data + body if body else data

    async def _exchange(self, loop: asyncio.AbstractEventLoop, conn: _Connection, data: bytes, deadline: float,
                        read_timeout: float | None) -> Any:
        """One request on `conn`: its whole answer (`conn` then goes back to the idle ones if it may be reused),
        or, given a `read_timeout`, its stream once the head is in (`conn` comes back when the stream is closed)."""
        waiter: asyncio.Future[Any] = loop.create_future()
        timer = loop.call_at(deadline, _expire, waiter, "the upstream did not answer in time")
        stream = None if read_timeout is None else StreamedAnswer(self, conn, loop, read_timeout)
        try:
            conn.send(data, waiter, stream)
            answer = await waiter
        except BaseException:
            conn.abort()  # mid-answer (timeout, cancellation, a cut): no one else may read what is left
            raise
        finally:
            timer.cancel()
        if stream is None:
            self.put_back(conn)
        return answer

    def put_back(self, conn: _Connection) -> None:
        """A connection whose answer was read whole: kept for the next call if it may be, else closed."""
        if conn.reusable and not conn.closed and not self._closed:
            conn.idle_since = asyncio.get_running_loop().time()
            self._idle.append(conn)
            self._wake_one()
        else:
            conn.abort()

    def forget(self, conn: _Connection) -> None:
        """A connection has closed: its place is free (called by the connection itself; once counts)."""
        if conn.counted:
            conn.counted = False
            self._open -= 1
        try:
            self._idle.remove(conn)
        except ValueError:
            pass
        self._wake_one()

    async def close(self) -> None:
        """Close every idle connection and refuse new calls; calls in flight end on their own."""
        self._closed = True
        while self._idle:
            self._idle.pop().abort()

    def _reuse(self, now: float) -> _Connection | None:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and not conn.transport.is_closing() and now - conn.idle_since < self._keepalive_s:  # type: ignore[union-attr]
                return conn
            conn.abort()
        return None

    async def _connect(self, loop: asyncio.AbstractEventLoop, deadline: float) -> _Connection:
        if self._closed:
            raise ConnectionError("the upstream's connection pool is closed")
        try:
            async with asyncio.timeout_at(deadline):
                while self._open >= self._max:  # wait for a place; a freed idle one is taken from the deque
                    waiter = loop.create_future()
                    self._room_waiters.append(waiter)
                    try:
                        await waiter
                    except BaseException:
                        if waiter.done() and not waiter.cancelled():
                            self._wake_one()  # woken as it left (timeout, cancellation): the place goes to the next
                        raise
                    conn = self._reuse(loop.time())
                    if conn is not None:
                        return conn
                self._open += 1
                conn = _Connection(self)  # holds the place just taken, given back by `forget`
                try:
                    async with asyncio.timeout(self._connect_s):
                        await loop.create_connection(
                            lambda: conn, self._host, self._port, ssl=self._ssl,
                            server_hostname=self._host if self._ssl is not None else None)
                except BaseException:
                    conn.abort()
                    self.forget(conn)
                    raise
        except TimeoutError:
            raise TimeoutError("connecting to the upstream timed out") from None
        return conn

    def _wake_one(self) -> None:
        while self._room_waiters:
            waiter = self._room_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


def _expire(waiter: asyncio.Future[Any], message: str) -> None:
    """A wait's time is up: its waiter fails with `TimeoutError`, unless answered meanwhile."""
    if not waiter.done():
        waiter.set_exception(TimeoutError(message))


def _header_line(name: str, value: str) -> str:
    """`name: value\\r\\n`, refusing characters that would end the line (header injection)."""
    if not _UNSAFE.isdisjoint(name) or not _UNSAFE.isdisjoint(value):
        raise ValueError(f"header {name!r} holds a line break or NUL")
    return f"{name}: {value}\r\n"


Origin = tuple[str, str, int]
"""(scheme, host, port): what one pool's connections go to."""


def origin_of(url: Any) -> Origin:
    """`url`'s origin (a `yarl.URL`, or the text of one that did not parse: `InvalidUpstreamURL`)."""
    if isinstance(url, str) or url.scheme not in ("http", "https") or not url.host or url.port is None:
        raise InvalidUpstreamURL(f"not an http(s) URL with a host: {str(url)[:200]!r}")
    return url.scheme, url.host, url.port
