"""A lean HTTP/1.1 client for an upstream's one-shot calls: keep-alive connections on asyncio protocols,
answers read by llhttp (`httptools`).

Why not aiohttp's `ClientSession` here: each of its calls builds a request object, a response object, a
stream reader, timers and trace hooks, about 3,300 Python bytecodes per call, as much as all of the broker's
own work on a request (`python -m bench bytecodes`). A call here writes one buffer, lets the C parser fill
one answer, and wakes its caller once. Streams stay on aiohttp, whose reader is made for answers that come
in pieces over minutes.

The errors are Python's own: `TimeoutError` once the call's time is up, `OSError`s when connecting fails
or the connection drops before the answer is whole (`ConnectionResetError`), `MalformedAnswer` when the
bytes are not HTTP. `providers.openai.wire.translated_errors` maps them like aiohttp's.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httptools
from multidict import CIMultiDict

_USER_AGENT = "mergebroker"
_ENCODINGS = "gzip, deflate"
_UNSAFE = frozenset("\r\n\0")


class MalformedAnswer(Exception):
    """The upstream's bytes are not a well-formed HTTP/1.1 answer."""


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
        self._waiter: asyncio.Future[Answer] | None = None
        self._head = b""  # what came before the headers were complete (the head, perhaps some body)
        self._body: list[bytes] = []
        self._headers_done = False
        self._heard = False  # any byte of the current answer
        self.reusable = False
        self.counted = True  # holds one of the pool's places until `Http1Pool.forget`

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, data: bytes, waiter: asyncio.Future[Answer]) -> None:
        """Write one request; `waiter` gets its answer."""
        self._parser = httptools.HttpResponseParser(self)
        self._waiter, self._head, self._body = waiter, b"", []
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

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self.reusable = self._parser.should_keep_alive()  # type: ignore[union-attr]
        self._finish()

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

    def _delimited(self) -> bool:
        """Whether the answer said where it ends (a length or chunks), so a close before then is a cut."""
        head = self._head.lower()
        return b"\ncontent-length:" in head or b"\ntransfer-encoding:" in head


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
        self._origin = (scheme, host, port)
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

    async def request(self, method: str, target: str, body: bytes | None, headers: Mapping[str, str] | None,
                      timeout: float) -> Answer:
        """Send one request (`target`: path and query) and read its whole answer within `timeout` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        head = f"{method} {target} HTTP/1.1\r\n{self._fixed}"
        if headers:
            head += "".join(_header_line(k, v) for k, v in headers.items())
        length = len(body) if body is not None else 0
        data = (head + f"Content-Length: {length}\r\n\r\n").encode()
        if body:
            data += body
        conn = self._reuse(loop.time())
        if conn is not None:
            try:
                return await self._exchange(loop, conn, data, deadline)
            except _Unanswered:
                # Closed by the upstream as it went idle, just as this call went out (the keep-alive race):
                # the request was never read, so it goes once more on a fresh connection.
                pass
        return await self._exchange(loop, await self._connect(loop, deadline), data, deadline)

    async def _exchange(self, loop: asyncio.AbstractEventLoop, conn: _Connection, data: bytes,
                        deadline: float) -> Answer:
        """One request on `conn` and its answer; `conn` goes back to the idle ones if it may be reused."""
        waiter: asyncio.Future[Answer] = loop.create_future()
        timer = loop.call_at(deadline, _expire, waiter)
        try:
            conn.send(data, waiter)
            answer = await waiter
        except BaseException:
            conn.abort()  # mid-answer (timeout, cancellation, a cut): no one else may read what is left
            raise
        finally:
            timer.cancel()
        if conn.reusable and not conn.closed and not self._closed:
            conn.idle_since = loop.time()
            self._idle.append(conn)
            self._wake_one()
        else:
            conn.abort()
        return answer

    def serves(self, url: Any) -> bool:
        """Whether `url` (a `yarl.URL`) is on this pool's origin."""
        return (url.scheme, url.host, url.port) == self._origin

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


def _expire(waiter: asyncio.Future[Answer]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError("the upstream did not answer in time"))


def _header_line(name: str, value: str) -> str:
    """`name: value\\r\\n`, refusing characters that would end the line (header injection)."""
    if not _UNSAFE.isdisjoint(name) or not _UNSAFE.isdisjoint(value):
        raise ValueError(f"header {name!r} holds a line break or NUL")
    return f"{name}: {value}\r\n"


def pool_for(url: Any, *, headers: Mapping[str, str], max_connections: int, keepalive_timeout_s: float,
             connect_timeout_s: float) -> Http1Pool | None:
    """A pool for `url`'s origin (a `yarl.URL`), or None where this client does not go (not plain http(s))."""
    if url.scheme not in ("http", "https") or not url.host or url.port is None:
        return None
    return Http1Pool(url.scheme, url.host, url.port, headers=headers, max_connections=max_connections,
                     keepalive_timeout_s=keepalive_timeout_s, connect_timeout_s=connect_timeout_s)
