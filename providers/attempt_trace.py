"""What one upstream attempt's CLIENT span says (`mergebroker.tracing`): which GenAI provider and server it
went to, and what its reply reported (model, usage, finish reasons), for plain calls and for streams.

Used by the pools only while tracing is on. A stream's span ends when the stream does (its last chunk,
a failure, or an early close), with what its chunks reported on the way.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import urlsplit

from mergebroker import jsonio, tracing
from mergebroker.providers.anthropic.provider import AnthropicProvider
from mergebroker.providers.openai.azure import AzureOpenAIProvider
from mergebroker.providers.upstream import Upstream
from mergebroker.token_usage import TokenUsage

_peers: dict[int, tracing.Peer] = {}


def peer_of(u: Upstream) -> tracing.Peer:
    """The GenAI provider name (per the provider's kind) and server address of `u`, worked out once."""
    found = _peers.get(id(u.provider))
    if found is None:
        provider = u.provider
        kind = ("anthropic" if isinstance(provider, AnthropicProvider)
                else "azure.ai.openai" if isinstance(provider, AzureOpenAIProvider) else "openai")
        # The base URL is the provider's own (not part of the Provider seam): a fake has none.
        url = urlsplit(getattr(provider, "_base_url", "") or "")
        try:
            port = url.port or ({"https": 443, "http": 80}.get(url.scheme) if url.hostname else None)
        except ValueError:
            port = None
        found = _peers[id(provider)] = tracing.Peer(kind, url.hostname, port)
    return found


def input_text(body: dict[str, Any]) -> str | None:
    """The request's messages as JSON text, for `gen_ai.input.messages` (asked only when content is recorded)."""
    if not tracing.record_content():
        return None
    messages = body.get("messages", body.get("input"))
    return jsonio.dumps(messages).decode() if messages is not None else None


def reply_seen(span: tracing.AttemptSpan, reply: Any, now: float) -> None:
    """End `span` with what a whole reply reports (OpenAI chat, Responses, Anthropic, embeddings shapes)."""
    if not isinstance(reply, dict):
        span.succeeded(now)
        return
    usage = TokenUsage.from_body(reply)
    reasons: list[str] = []
    text = None
    for choice in reply.get("choices") or ():
        if isinstance(choice, dict):
            reasons.append(str(choice.get("finish_reason") or ""))
            if text is None and isinstance(choice.get("message"), dict):
                text = choice["message"].get("content")
    for key in ("stop_reason", "status"):  # Anthropic, Responses
        if isinstance(reply.get(key), str):
            reasons.append(reply[key])
    model = reply.get("model")
    span.succeeded(now, response_model=model if isinstance(model, str) else None,
                   input_tokens=usage.prompt_tokens if usage else None,
                   output_tokens=usage.completion_tokens if usage else None,
                   cache_read_tokens=usage.cached_tokens if usage else None, finish_reasons=reasons,
                   output_text=text if isinstance(text, str) else None)


class TracedStream:
    """An upstream stream whose attempt span ends with it, carrying what its chunks reported."""

    def __init__(self, stream: AsyncIterator[bytes], span: tracing.AttemptSpan, clock: Callable[[], float]) -> None:
        self._stream = stream
        self._span: tracing.AttemptSpan | None = span
        self._clock = clock
        self._model: str | None = None
        self._usage: TokenUsage | None = None
        self._reasons: list[str] = []
        self.whole_reply: dict[str, Any] | None = getattr(stream, "whole_reply", None)

    def __aiter__(self) -> TracedStream:
        return self

    async def __anext__(self) -> bytes:
        try:
            chunk = await self._stream.__anext__()
        except StopAsyncIteration:
            self._end(None)
            raise
        except BaseException as exc:
            self._end(exc)
            raise
        self._read(chunk)
        return chunk

    async def aclose(self) -> None:
        """End the stream early: the span ends with what was seen."""
        self._end(None)
        aclose = getattr(self._stream, "aclose", None)
        if aclose is not None:
            await aclose()

    def _read(self, chunk: bytes) -> None:
        for line in chunk.split(b"\n"):
            if not line.startswith(b"data:") or line.endswith(b"[DONE]"):
                continue
            try:
                event = jsonio.loads(line[5:])
            except ValueError:
                continue
            if not isinstance(event, dict):
                continue
            inner = event.get("message")  # Anthropic's message_start carries the model and input usage
            message: dict[str, Any] = inner if isinstance(inner, dict) else event
            if self._model is None and isinstance(message.get("model"), str):
                self._model = message["model"]
            for choice in event.get("choices") or ():
                if isinstance(choice, dict) and choice.get("finish_reason"):
                    self._reasons.append(str(choice["finish_reason"]))
            usage = TokenUsage.from_body(message) if "usage" in message else None
            self._usage = usage or self._usage

    def _end(self, exc: BaseException | None) -> None:
        span, self._span = self._span, None
        if span is None:
            return
        if exc is not None and not isinstance(exc, GeneratorExit):
            span.failed(self._clock(), exc)
            return
        if self.whole_reply is not None:
            reply_seen(span, self.whole_reply, self._clock())
            return
        usage = self._usage
        span.succeeded(self._clock(), response_model=self._model,
                       input_tokens=usage.prompt_tokens if usage else None,
                       output_tokens=usage.completion_tokens if usage else None,
                       cache_read_tokens=usage.cached_tokens if usage else None, finish_reasons=self._reasons)
