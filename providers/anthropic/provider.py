"""One upstream speaking Anthropic's Messages API, presented to the broker as an OpenAI provider.

The HTTP side (pooled session, timeouts, error translation, SSE framing) is `OpenAICompatProvider`'s;
this class only swaps the endpoint, the headers and the bodies, with every decision in the pure
translation modules (`providers.anthropic_translate` for requests, `anthropic_reply` and
`anthropic_stream` for answers, `anthropic_errors`). A field the Messages API cannot carry is refused
(400, naming it) before anything is sent. Anthropic has no embeddings endpoint: embeddings calls are
refused the same way.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from mergebroker.errors import UpstreamBadResponse, UpstreamHTTPError, UpstreamUnsupported
from mergebroker.providers.anthropic.errors import to_error
from mergebroker.providers.anthropic.reply import to_completion
from mergebroker.providers.anthropic.stream import StreamTranslator
from mergebroker.providers.anthropic.structured import NATIVE_STRUCTURED_OUTPUT
from mergebroker.providers.anthropic.translate import ANTHROPIC_VERSION, MessagesCall, to_messages
from mergebroker.providers.openai.compat import HttpProviderSettings, OpenAICompatProvider
from mergebroker.providers.openai.wire import decode_json
from mergebroker.providers.retry import parse_retry_after


class AnthropicProvider(OpenAICompatProvider):
    """A `providers.base.Provider` over `POST {base_url}/v1/messages` with `x-api-key` and `anthropic-version`.

    `base_url` is the API root, with or without its `/v1` ("https://api.anthropic.com"). `api_key`
    travels as `x-api-key`, never as a Bearer token. `default_max_tokens` fills the `max_tokens` the
    Messages API requires when a request names none; `model_map` renames the callers' model names.
    `native_structured_output` lists the Anthropic models (glob patterns) given `response_format:
    json_schema` natively; others get the forced-tool technique. `wall_clock` stamps `created` on
    translated answers (Unix seconds).
    """

    def __init__(self, settings: HttpProviderSettings, *, default_max_tokens: int,
                 anthropic_version: str = ANTHROPIC_VERSION, model_map: Mapping[str, str] | None = None,
                 native_structured_output: Sequence[str] = NATIVE_STRUCTURED_OUTPUT,
                 wall_clock: Callable[[], float] = time.time) -> None:
        headers = [("anthropic-version", anthropic_version), *settings.extra_headers]
        if settings.api_key:
            headers.append(("x-api-key", settings.api_key))
        root = settings.base_url.rstrip("/").removesuffix("/v1")
        super().__init__(replace(settings, base_url=root + "/v1", api_key=None, extra_headers=tuple(headers)))
        self._default_max_tokens = default_max_tokens
        self._model_map = dict(model_map or {})
        self.native_apis = frozenset({"messages", "count_tokens"})  # what Claude Code and the SDK send, as sent
        self._native = tuple(native_structured_output)
        self._wall_clock = wall_clock

    def __repr__(self) -> str:
        return f"AnthropicProvider(name={self.name!r}, base_url={self._base_url!r})"

    def _translate(self, body: Mapping[str, Any]) -> MessagesCall:
        return to_messages(body, default_max_tokens=self._default_max_tokens, model_map=self._model_map,
                           native_structured_output=self._native)

    def _upstream_error(self, status: int, headers: Any, raw: bytes) -> UpstreamHTTPError:
        return to_error(status, decode_json(raw), retry_after=parse_retry_after(headers.get("Retry-After")))

    async def chat(self, body: dict[str, Any], *, timeout: float) -> dict[str, Any]:
        """POST /v1/messages; the answer as a `chat.completion`."""
        call = self._translate(body)
        message = await self._request_json("POST", "/messages", call.body, timeout)
        return to_completion(message, created=int(self._wall_clock()), shape=call.shape)

    def stream_chat(self, body: dict[str, Any], *, timeout: float) -> AsyncIterator[bytes]:
        """POST /v1/messages with `stream: true`; yield `chat.completion.chunk` SSE events ending in `[DONE]`.

        Translation errors raise here, before any connection is made. An `error` event raises its
        mapped error; a stream that ends before `message_stop` raises `UpstreamBadResponse`.
        """
        call = self._translate(body)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        translator = StreamTranslator(int(self._wall_clock()), include_usage, call.shape)
        return self._translated_stream({**call.body, "stream": True}, translator, timeout)

    async def _translated_stream(self, request: dict[str, Any], translator: StreamTranslator,
                                 timeout: float) -> AsyncIterator[bytes]:
        async for event in self._sse_events("/messages", request, timeout):
            for chunk in translator.feed(event):
                yield chunk
        if not translator.done:
            raise UpstreamBadResponse("upstream ended the stream before message_stop")

    async def embeddings(self, body: dict[str, Any], *, timeout: float) -> dict[str, Any]:
        """Refused: the Messages API has no embeddings (a pool tries the model's other upstreams)."""
        raise UpstreamUnsupported(f"Provider '{self.name}' (Anthropic) has no embeddings endpoint.", param="model")
