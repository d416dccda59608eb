"""The lean HTTP/1.1 client keeps connections alive, reads every framing of an answer, survives the keep-alive
race, and fails each broken answer with the error `translated_errors` maps (real loopback servers)."""

from __future__ import annotations

import asyncio
import gzip
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import trustme

from mergebroker.errors import UpstreamBadResponse, UpstreamConnectionError, UpstreamHTTPError, UpstreamTimeout
from mergebroker.providers.http1_client import Http1Pool, MalformedAnswer
from mergebroker.providers.openai.compat import HttpProviderSettings, OpenAICompatProvider

Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]
"""A raw server's handling of one connection (its number, from 1)."""


class RawServer:
    """A loopback server answering each connection with `serve`; counts the connections it took."""

    def __init__(self, serve: Serve) -> None:
        self._serve = serve
        self.connections = 0
        self.port = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> RawServer:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self._serve(reader, writer, self.connections)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request's head and body (by its Content-Length)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    return head + await reader.readexactly(length)


def ok(body: bytes, *extra: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), b"".join(e + b"\r\n" for e in extra),
                                                                  body)


def pool(port: int, *, max_connections: int = 10) -> Http1Pool:
    return Http1Pool("http", "127.0.0.1", port, headers={"Authorization": "Bearer k"},
                     max_connections=max_connections, keepalive_timeout_s=30.0, connect_timeout_s=5.0)


@pytest.fixture
async def keep_alive_server() -> AsyncIterator[RawServer]:
    """Answers every request on a connection with its own request line, keeping the connection open."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _n: int) -> None:
        while True:
            request = await read_request(reader)
            writer.write(ok(request.split(b"\r\n", 1)[0]))

    async with RawServer(serve) as server:
        yield server


async def test_calls_share_one_keep_alive_connection_and_carry_the_fixed_headers(keep_alive_server: RawServer) -> None:
    seen: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _n: int) -> None:
        while True:
            seen.append(await read_request(reader))
            writer.write(ok(b"{}"))

    async with RawServer(serve) as server:
        client = pool(server.port)
        for n in range(3):
            answer = await client.request("POST", "/v1/chat/completions", b'{"n": %d}' % n,
                                          {"Content-Type": "application/json"}, 5.0)
            assert (answer.status, answer.body) == (200, b"{}")
        await client.close()
    assert server.connections == 1
    assert seen[2].startswith(b"POST /v1/chat/completions HTTP/1.1\r\n") and seen[2].endswith(b'{"n": 2}')
    assert b"Authorization: Bearer k\r\n" in seen[0] and b"Host: 127.0.0.1:%d\r\n" % server.port in seen[0]


async def test_an_idle_connection_the_upstream_closed_as_the_call_went_out_is_retried_on_a_fresh_one() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(ok(b"first" if n == 1 else b"fresh"))
        if n == 1:  # the keep-alive race: the next request arrives just as the server closes the connection
            await read_request(reader)

    async with RawServer(serve) as server:
        client = pool(server.port)
        assert (await client.request("GET", "/v1/models", None, None, 5.0)).body == b"first"
        assert (await client.request("POST", "/v1/chat/completions", b"{}", None, 5.0)).body == b"fresh"
        await client.close()
    assert server.connections == 2


@pytest.mark.parametrize(("answer", "body"), [
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n", b"abcde"),
    (b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end", b"until the end"),  # ends with its connection
    (b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%s"
     % (len(gzip.compress(b"zipped")), gzip.compress(b"zipped")), b"zipped"),
])
async def test_every_framing_of_an_answer_is_read_whole(answer: bytes, body: bytes) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _n: int) -> None:
        await read_request(reader)
        writer.write(answer)
        await writer.drain()

    async with RawServer(serve) as server:
        client = pool(server.port)
        assert (await client.request("GET", "/", None, None, 5.0)).body == body
        await client.close()


async def test_a_cut_answer_a_malformed_one_and_a_silent_upstream_each_fail_as_the_provider_maps_them() -> None:
    replies = {"/cut": b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"partial", "/junk": b"NOT HTTP AT ALL\r\n\r\n"}

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _n: int) -> None:
        request = await read_request(reader)
        path = request.split(b" ")[1].decode().removeprefix("/v1")
        if path in replies:
            writer.write(replies[path])
            await writer.drain()
        else:
            await asyncio.Event().wait()  # never answers

    async with RawServer(serve) as server:
        client = pool(server.port)
        with pytest.raises(ConnectionResetError):
            await client.request("GET", "/v1/cut", None, None, 5.0)
        with pytest.raises(MalformedAnswer):
            await client.request("GET", "/v1/junk", None, None, 5.0)
        with pytest.raises(TimeoutError):
            await client.request("GET", "/v1/silent", None, None, 0.2)
        await client.close()

        provider = OpenAICompatProvider(HttpProviderSettings(name="raw", base_url=f"http://127.0.0.1:{server.port}/v1"))
        for endpoint, error in (("/cut", UpstreamConnectionError), ("/junk", UpstreamBadResponse),
                                ("/silent", UpstreamTimeout)):
            with pytest.raises(error):
                await provider._request_json("GET", endpoint, None, 0.2)
        await provider.close()


async def test_a_connection_left_mid_answer_is_closed_never_reused() -> None:
    release, first_closed = asyncio.Event(), asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while True:
            try:
                await read_request(reader)
            except (asyncio.IncompleteReadError, ConnectionResetError):  # closed, or reset with the answer unread
                if n == 1:
                    first_closed.set()  # the client closed it: its place is not held by a dead connection
                raise
            if n == 1:
                await release.wait()  # answers the first call only after its caller has left
            writer.write(ok(b"for connection %d" % n))

    async with RawServer(serve) as server:
        client = pool(server.port)
        call = asyncio.ensure_future(client.request("GET", "/", None, None, 5.0))
        while server.connections == 0:
            await asyncio.sleep(0)
        call.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await call
        await asyncio.wait_for(first_closed.wait(), 5)
        assert (await client.request("GET", "/", None, None, 5.0)).body == b"for connection 2"
        await client.close()


async def test_calls_beyond_max_connections_wait_for_a_connection_to_come_back() -> None:
    gate = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _n: int) -> None:
        while True:
            await read_request(reader)
            await gate.wait()
            writer.write(ok(b"done"))

    async with RawServer(serve) as server:
        client = pool(server.port, max_connections=1)
        calls = [asyncio.ensure_future(client.request("GET", "/", None, None, 5.0)) for _ in range(3)]
        while server.connections == 0:
            await asyncio.sleep(0)
        gate.set()
        assert [a.body for a in await asyncio.gather(*calls)] == [b"done"] * 3
        await client.close()
    assert server.connections == 1


def test_a_header_that_would_break_its_line_is_refused() -> None:
    with pytest.raises(ValueError, match="line break"):
        Http1Pool("http", "127.0.0.1", 80, headers={"X-Evil": "a\r\nInjected: yes"}, max_connections=1,
                  keepalive_timeout_s=1.0, connect_timeout_s=1.0)


async def test_a_refused_connection_is_a_connection_error(unused_tcp_port: int) -> None:
    provider = OpenAICompatProvider(HttpProviderSettings(name="gone", base_url=f"http://127.0.0.1:{unused_tcp_port}/v1"))
    with pytest.raises(UpstreamConnectionError):
        await provider._request_json("GET", "/models", None, 2.0)
    await provider.close()


async def test_a_refusal_carries_the_upstreams_message_and_retry_after_from_its_headers() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _n: int) -> None:
        await read_request(reader)
        body = b'{"error": {"message": "slow down"}}'
        writer.write(b"HTTP/1.1 429 Too Many Requests\r\nretry-AFTER: 7\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()

    async with RawServer(serve) as server:
        provider = OpenAICompatProvider(HttpProviderSettings(name="raw", base_url=f"http://127.0.0.1:{server.port}/v1"))
        with pytest.raises(UpstreamHTTPError) as refused:
            await provider._request_json("POST", "/chat/completions", {"model": "m"}, 5.0)
        await provider.close()
    assert (refused.value.status, refused.value.retry_after, str(refused.value)) == (429, 7.0, "slow down")


async def test_a_stream_hands_over_each_piece_as_it_comes_and_its_connection_serves_the_next_call() -> None:
    next_piece = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"7\r\ndata: 1\r\n")
        await next_piece.wait()  # the second piece goes only once the first has reached the reader
        writer.write(b"7\r\ndata: 2\r\n0\r\n\r\n")
        while True:
            await read_request(reader)
            writer.write(ok(b"again"))

    async with RawServer(serve) as server:
        client = pool(server.port)
        answer = await client.open_stream("POST", "/v1/chat/completions", b"{}", None, 5.0)
        assert (answer.status, answer.content_type) == (200, "text/event-stream")
        pieces = []
        async for piece in answer.chunks():
            pieces.append(piece)
            next_piece.set()
        answer.close()
        assert pieces == [b"data: 1", b"data: 2"]
        assert (await client.request("GET", "/", None, None, 5.0)).body == b"again"
        await client.close()
    assert server.connections == 1


async def test_a_stream_that_goes_quiet_past_its_read_timeout_fails_and_one_left_mid_answer_is_closed() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await asyncio.Event().wait()  # then nothing more

    async with RawServer(serve) as server:
        client = pool(server.port)
        answer = await client.open_stream("POST", "/", b"{}", None, 0.2)
        chunks = answer.chunks()
        assert await chunks.__anext__() == b"first"
        with pytest.raises(TimeoutError):
            await chunks.__anext__()
        answer.close()
        left = await client.open_stream("POST", "/", b"{}", None, 5.0)
        left.close()  # mid-answer: its connection cannot serve another call
        assert server.connections == 2
        await client.open_stream("POST", "/", b"{}", None, 5.0)
        assert server.connections == 3
        await client.close()


async def test_a_large_streamed_body_arrives_whole_through_the_pauses_of_a_slow_reader() -> None:
    body = bytes(range(256)) * 8192  # 2 MiB, well past the unread bytes at which the socket pauses

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
        for start in range(0, len(body), 65536):
            writer.write(body[start:start + 65536])
            await writer.drain()

    async with RawServer(serve) as server:
        client = pool(server.port)
        answer = await client.open_stream("POST", "/", b"{}", None, 5.0)
        for _ in range(100):  # the reader lags: the body piles up until the socket pauses
            await asyncio.sleep(0)
        assert await answer.read() == body
        answer.close()
        await client.close()


async def test_an_https_upstream_is_reached_only_with_a_certificate_the_system_trusts_for_its_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(server_context)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _n: int) -> None:
        while True:
            await read_request(reader)
            writer.write(ok(b'{"data": []}'))

    server = await asyncio.start_server(lambda r, w: serve(r, w, 0), "127.0.0.1", 0, ssl=server_context)
    port = server.sockets[0].getsockname()[1]
    try:
        untrusted = Http1Pool("https", "localhost", port, headers={}, max_connections=1, keepalive_timeout_s=1.0,
                              connect_timeout_s=5.0)
        with pytest.raises(ssl.SSLCertVerificationError):  # an OSError: the provider's connection error
            await untrusted.request("GET", "/v1/models", None, None, 5.0)
        await untrusted.close()

        ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
        monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "ca.pem"))  # the system's trust store, as OpenSSL reads it
        trusted = Http1Pool("https", "localhost", port, headers={}, max_connections=1, keepalive_timeout_s=1.0,
                            connect_timeout_s=5.0)
        assert (await trusted.request("GET", "/v1/models", None, None, 5.0)).body == b'{"data": []}'
        await trusted.close()
    finally:
        server.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_an_interim_answer_is_skipped_for_the_final_one(stream: bool) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _n: int) -> None:
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n")
            await writer.drain()
            writer.write(ok(b"final", b"X-Final: yes"))

    async with RawServer(serve) as server:
        client = pool(server.port)
        for _ in range(2):  # and the connection stays good for the next call
            if stream:
                answer = await client.open_stream("POST", "/", b"{}", None, 5.0)
                status, final, body = answer.status, answer.headers.get("X-Final"), await answer.read()
                answer.close()
            else:
                whole = await client.request("POST", "/", b"{}", None, 5.0)
                status, final, body = whole.status, whole.headers.get("X-Final"), whole.body
            assert (status, final, body) == (200, "yes", b"final")
        await client.close()
    assert server.connections == 1
