"""One upstream speaking the OpenAI HTTP API, over one keep-alive pool per provider (`providers.http1_client`).

Every failure of the HTTP client is translated here into the `broker.errors.UpstreamError` family, so
nothing above this module sees it. Each call is exactly one attempt; retries live in `providers.retry`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog
from yarl import URL

from mergebroker import jsonio, tracing
from mergebroker.errors import (
    UpstreamBadResponse,
    UpstreamError,
    UpstreamHTTPError,
)
from mergebroker.providers.http1_client import Http1Pool, Origin, origin_of
from mergebroker.providers.native_api import ENDPOINTS, NativeMode, lacks_route, not_native
from mergebroker.providers.openai.wire import decode_json, http_error, translated_errors
from mergebroker.providers.whole_reply import (
    ProviderStream,
    StreamSupport,
    plain_request,
    replay_chunks,
    streaming_refusal,
)

log = structlog.get_logger(__name__)

_JSON_CONTENT = {"Content-Type": "application/json"}
_SSE_REQUEST = {**_JSON_CONTENT, "Accept": "text/event-stream"}

_NARROWNESS = {StreamSupport.FULL: 0, StreamSupport.WITHOUT_OPTIONS: 1, StreamSupport.NONE: 2}

DEFAULT_TOKEN_RATE = 50.0
"""Generation speed (tokens/s) assumed when sizing a read timeout: slow enough for a loaded hosted model."""


@dataclass(frozen=True)
class HttpProviderSettings:
    """Where one upstream lives and how its connection pool behaves.

    `base_url` ends before the endpoint ("http://127.0.0.1:8001/v1"). `api_key` is sent as a Bearer
    token; it and `extra_headers` (which may hold other credentials) stay out of `repr`.
    """

    name: str
    base_url: str
    api_key: str | None = field(default=None, repr=False)
    max_connections: int = 100
    keepalive_timeout_s: float = 30.0
    connect_timeout_s: float = 5.0
    extra_headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    responses: NativeMode = "auto"
    model_map: tuple[tuple[str, str], ...] = ()


def read_timeout_for(max_tokens: int | None, *, token_rate: float = DEFAULT_TOKEN_RATE, base_s: float = 5.0,
                     default_tokens: int = 1024) -> float:
    """A call budget for generating `max_tokens` at `token_rate` tokens/s, plus `base_s` for queueing and prefill.

    A missing or non-positive `max_tokens` counts as `default_tokens`.
    """
    if token_rate <= 0:
        raise ValueError("token_rate must be positive")
    tokens = max_tokens if max_tokens is not None and max_tokens > 0 else default_tokens
    return tokens / token_rate + base_s


def _chat_reply(data: Any) -> dict[str, Any]:
    """`data` if it is a chat answer (a JSON object with choices), else `UpstreamBadResponse`."""
    if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
        raise UpstreamBadResponse("upstream chat answer has no choices")
    return data


def _split_events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Complete SSE events (each ending in a blank line) from `buffer`, and the unfinished rest."""
    buffer = buffer.replace(b"\r\n", b"\n")
    events = []
    while (end := buffer.find(b"\n\n")) != -1:
        events.append(buffer[: end + 2])
        buffer = buffer[end + 2:]
    return events, buffer


class OpenAICompatProvider:
    """A `providers.base.Provider` over HTTP: one keep-alive pool (`providers.http1_client`) per upstream, for
    one-shot calls and streams alike, created on first use and closed by `close()`."""

    def __init__(self, settings: HttpProviderSettings) -> None:
        self.name = settings.name
        self._settings = settings
        self._base_url = settings.base_url.rstrip("/")
        self._pools: dict[Origin, Http1Pool] = {}  # created on first use, inside the running loop
        self._urls: dict[str, URL] = {}  # parsed once per endpoint, not per call
        self._stream_support = StreamSupport.FULL  # narrowed for good by what the upstream refuses
        self._model_map = dict(settings.model_map)
        self.native_apis: frozenset[str] = frozenset() if settings.responses == "translate" else frozenset({"responses"})

    def __repr__(self) -> str:
        return f"OpenAICompatProvider(name={self.name!r}, base_url={self._base_url!r})"

    def _pool(self, url: URL | str) -> Http1Pool:
        """The keep-alive pool of `url`'s origin (one per upstream, but for a subclass whose URLs leave it)."""
        origin = origin_of(url)
        pool = self._pools.get(origin)
        if pool is None:
            s = self._settings
            pool = self._pools[origin] = Http1Pool(*origin, headers=self._session_headers(),
                                                   max_connections=s.max_connections,
                                                   keepalive_timeout_s=s.keepalive_timeout_s,
                                                   connect_timeout_s=s.connect_timeout_s)
        return pool

    def _session_headers(self) -> dict[str, str]:
        """What every call carries: the configured extra headers and the API key."""
        headers = dict(self._settings.extra_headers)
        if self._settings.api_key:
            headers["Authorization"] = f"Bearer {self._settings.api_key}"
        return headers

    def _url(self, endpoint: str) -> URL | str:
        url = self._urls.get(endpoint)
        if url is None:
            try:
                url = self._urls[endpoint] = URL(self._base_url + endpoint)
            except ValueError:  # refused by `origin_of` when called, inside `translated_errors`
                return self._base_url + endpoint
        return url

    def _endpoint_url(self, endpoint: str, body: dict[str, Any] | None) -> URL | str:
        """Where a call to `endpoint` with `body` goes; a provider with per-model paths overrides this."""
        return self._url(endpoint)

    def _upstream_error(self, status: int, headers: Any, raw: bytes) -> UpstreamHTTPError:
        """The error for a non-2xx answer; a provider with another error envelope overrides this."""
        return http_error(status, headers, raw)

    def _mapped(self, body: dict[str, Any]) -> dict[str, Any]:
        """`body` with the callers' model name renamed to the upstream's (`model_map`)."""
        model = body.get("model")
        if not self._model_map or not isinstance(model, str) or model not in self._model_map:
            return body
        return {**body, "model": self._model_map[model]}

    async def _request_json(self, method: str, endpoint: str, body: dict[str, Any] | None,
                            timeout: float, extra_headers: Mapping[str, str] | None = None) -> dict[str, Any]:
        """One request; the parsed JSON object of a 2xx answer, or an `UpstreamError`."""
        with translated_errors(self.name, endpoint):
            data, headers = (None, None) if body is None else (jsonio.dumps(body), _JSON_CONTENT)
            if extra_headers:
                headers = {**(headers or {}), **extra_headers}
            if tracing.enabled():  # the attempt's CLIENT span is current: its traceparent goes along
                headers = tracing.inject(headers or {})  # a copy: the shared constants stay as they are
            url = self._endpoint_url(endpoint, body)
            answer = await self._pool(url).request(method, url.raw_path_qs, data, headers, timeout)  # type: ignore[union-attr]
            raw = answer.body
            if not 200 <= answer.status < 300:
                log.debug("provider_call_failed", provider=self.name, endpoint=endpoint, status=answer.status)
                raise self._upstream_error(answer.status, answer.headers, raw)
        data = decode_json(raw)
        if not isinstance(data, dict):
            raise UpstreamBadResponse(f"upstream {endpoint} answered 2xx without a JSON object")
        return data

    async def chat(self, body: dict[str, Any], *, timeout: float) -> dict[str, Any]:
        """POST /chat/completions; `timeout` bounds the whole call (connect to last byte)."""
        return _chat_reply(await self._request_json("POST", "/chat/completions", self._mapped(body), timeout))

    async def embeddings(self, body: dict[str, Any], *, timeout: float) -> dict[str, Any]:
        """POST /embeddings; `timeout` bounds the whole call."""
        data = await self._request_json("POST", "/embeddings", body, timeout)
        if not isinstance(data.get("data"), list):
            raise UpstreamBadResponse("upstream embeddings answer has no data")
        return data

    async def list_models(self, *, timeout: float) -> list[str]:
        """GET /models: the ids of the models the upstream serves."""
        data = await self._request_json("GET", "/models", None, timeout)
        models = data.get("data")
        if not isinstance(models, list) or not all(isinstance(m, dict) and "id" in m for m in models):
            raise UpstreamBadResponse("upstream models answer has no data")
        return [str(m["id"]) for m in models]

    def stream_chat(self, body: dict[str, Any], *, timeout: float) -> AsyncIterator[bytes]:
        """POST /chat/completions with `stream: true`; yield each complete SSE event as it arrives.

        Events are relayed one by one (never the whole response buffered), with "\\n" line endings
        and each ending in a blank line. `timeout` bounds the connect phase and every gap between
        chunks, the first byte included, but not the stream's total length: a long answer that keeps
        flowing is healthy, and the caller ends the stream early by closing the generator.
        Failures before the first event raise like `chat`; later ones raise the same errors mid-stream.

        An upstream that does not stream is served all the same (`providers.whole_reply`): a JSON answer
        is replayed as chunks, and a 400 refusing `stream_options` (or `stream`) is answered by sending the
        call without them. Either is remembered, so later calls stop asking; the returned stream's
        `whole_reply` is set when the answer came whole.
        """
        mapped = self._mapped(body)
        return ProviderStream(lambda stream: self._stream(mapped, timeout, stream, self._stream_support))

    async def _stream(self, body: dict[str, Any], timeout: float, stream: ProviderStream,
                      support: StreamSupport) -> AsyncIterator[bytes]:
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        if support is StreamSupport.NONE:
            stream.whole_reply = await self.chat(plain_request(body), timeout=timeout)
            for chunk in replay_chunks(stream.whole_reply, include_usage=include_usage):
                yield chunk
            return
        request = {**body, "stream": True}
        if support is StreamSupport.WITHOUT_OPTIONS:
            request.pop("stream_options", None)

        def whole(data: Any) -> list[bytes]:
            stream.whole_reply = _chat_reply(data)
            self._learn(StreamSupport.NONE)
            return replay_chunks(stream.whole_reply, include_usage=include_usage)

        events = self._sse_events("/chat/completions", request, timeout, on_json=whole)
        try:
            try:
                first = await events.__anext__()
            except UpstreamHTTPError as exc:
                narrower = streaming_refusal(exc, request)
                if narrower is None:
                    raise
                events = self._stream(body, timeout, stream, narrower)
                first = await events.__anext__()
                self._learn(narrower)  # only once the narrower request worked: a stray 400 teaches nothing
            yield first
            async for event in events:
                yield event
        except StopAsyncIteration:
            return  # no event at all: the caller sees an empty stream
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    def _learn(self, support: StreamSupport) -> None:
        """Remember that this upstream takes no more than `support` of a streaming request."""
        if _NARROWNESS[support] > _NARROWNESS[self._stream_support]:
            self._stream_support = support
            log.warning("upstream_streaming_narrowed", provider=self.name, support=support.value)

    async def native(self, api: str, body: dict[str, Any], *, headers: Mapping[str, str],
                     timeout: float) -> dict[str, Any]:
        """POST `body` as sent to the native endpoint of `api` (`providers.native_api`); the JSON answer.

        An API this upstream does not take natively is refused with `native_unsupported` before anything
        is sent; in `auto` mode a 404 or 405 teaches that the route is missing, for good."""
        if api not in self.native_apis:
            raise not_native(self.name, api)
        try:
            return await self._request_json("POST", ENDPOINTS[api], self._mapped(body), timeout, headers)
        except UpstreamHTTPError as exc:
            raise self._unlearn(api, exc) from exc

    async def stream_native(self, api: str, body: dict[str, Any], *, headers: Mapping[str, str],
                            timeout: float) -> AsyncIterator[bytes]:
        """POST `body` to the native endpoint of `api` and yield its SSE events as sent (see `native`)."""
        if api not in self.native_apis:
            raise not_native(self.name, api)
        events = self._sse_events(ENDPOINTS[api], self._mapped(body), timeout, extra_headers=headers)
        try:
            try:
                first = await events.__anext__()
            except UpstreamHTTPError as exc:
                raise self._unlearn(api, exc) from exc
            yield first
            async for event in events:
                yield event
        except StopAsyncIteration:
            return
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    def _unlearn(self, api: str, exc: UpstreamHTTPError) -> UpstreamError:
        """The error to raise for a native call's refusal: a missing route is remembered (auto mode) and
        sends the call to the translation; anything else is the upstream's answer."""
        if self._settings.responses != "auto" or api != "responses" or not lacks_route(exc):
            return exc
        self.native_apis = self.native_apis - {api}
        log.warning("upstream_lacks_native_api", provider=self.name, api=api, status=exc.upstream_status)
        return not_native(self.name, api)

    async def _sse_events(self, endpoint: str, body: dict[str, Any], timeout: float,
                          on_json: Callable[[Any], list[bytes]] | None = None,
                          extra_headers: Mapping[str, str] | None = None) -> AsyncIterator[bytes]:
        """POST `body` to `endpoint` and yield each complete SSE event (as `stream_chat` describes).

        A JSON answer is handed to `on_json`, whose events are yielded instead; without one, it is an
        `UpstreamBadResponse`.
        """
        headers: Mapping[str, str] = {**_SSE_REQUEST, **extra_headers} if extra_headers else _SSE_REQUEST
        if tracing.enabled():
            headers = tracing.inject(headers)
        with translated_errors(self.name, endpoint):
            url = self._endpoint_url(endpoint, body)
            answer = await self._pool(url).open_stream("POST", url.raw_path_qs, jsonio.dumps(body),  # type: ignore[union-attr]
                                                       headers, timeout)
            try:
                if not 200 <= answer.status < 300:
                    raise self._upstream_error(answer.status, answer.headers, await answer.read())
                content_type = answer.content_type
                if content_type == "application/json" or content_type.endswith("+json"):
                    if on_json is None:
                        raise UpstreamBadResponse("upstream answered JSON to a streaming request")
                    for event in on_json(decode_json(await answer.read())):
                        yield event
                    return
                buffer = b""
                async for chunk in answer.chunks():
                    events, buffer = _split_events(buffer + chunk)
                    for event in events:
                        yield event
                if buffer.strip():
                    # The upstream closed without the final blank line; relay what it sent, terminated.
                    yield buffer.rstrip(b"\n") + b"\n\n"
            finally:
                answer.close()

    async def warm_up(self, connections: int, *, timeout: float = 10.0) -> None:
        """Open up to `connections` keep-alive connections with concurrent `GET /models`; never raises."""
        count = max(0, min(connections, self._settings.max_connections))
        if count == 0:
            return
        results = await asyncio.gather(*(self.list_models(timeout=timeout) for _ in range(count)),
                                       return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        for failure in failures:
            if not isinstance(failure, Exception):  # cancellation is not a warm-up failure to swallow
                raise failure
        if failures:
            log.warning("provider_warmup_failed", provider=self.name, attempted=count, failed=len(failures),
                        error=type(failures[0]).__name__)
        else:
            log.debug("provider_warmed_up", provider=self.name, connections=count)

    async def close(self) -> None:
        """Close the connection pools; a later call opens new ones."""
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            await pool.close()
