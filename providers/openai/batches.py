"""A provider's own Batch API (`/files` and `/batches`), spoken over HTTP like `providers.openai_compat`.

The bulk runner uploads a compacted JSONL file, creates an upstream batch for it, polls it and reads
its output and error files back. Every call is one attempt with a fixed timeout; failures leave as the
`UpstreamError` family (translated by the same helpers as the chat client), and the runner decides
whether to poll again.
"""

from __future__ import annotations

from typing import Any, Protocol

import aiohttp

from mergebroker.errors import UpstreamBadResponse
from mergebroker.providers.openai.compat import HttpProviderSettings
from mergebroker.providers.openai.wire import decode_json, http_error, translated_errors

CALL_TIMEOUT_S = 60.0


class BatchApi(Protocol):
    """One provider's Batch API: upload a file, create/retrieve/cancel a batch, read a file back."""

    name: str

    async def upload(self, data: bytes, *, filename: str) -> str:
        """Upload a JSONL file for purpose "batch"; its file ID."""

    async def create_batch(self, input_file_id: str, *, endpoint: str, completion_window: str) -> dict[str, Any]:
        """Create a batch; its batch object."""

    async def retrieve_batch(self, batch_id: str) -> dict[str, Any]:
        """The batch object now."""

    async def cancel_batch(self, batch_id: str) -> dict[str, Any]:
        """Ask the provider to cancel; the batch object."""

    async def content(self, file_id: str) -> bytes:
        """A file's bytes (an output or error file)."""

    async def close(self) -> None:
        """Close connections."""


class OpenAIBatchClient:
    """`BatchApi` over HTTP for an OpenAI-compatible provider (one keep-alive session, made on first use)."""

    def __init__(self, settings: HttpProviderSettings) -> None:
        self.name = settings.name
        self._settings = settings
        self._base = settings.base_url.rstrip("/")
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = dict(self._settings.extra_headers)
            if self._settings.api_key:
                headers["Authorization"] = f"Bearer {self._settings.api_key}"
            self._session = aiohttp.ClientSession(headers=headers, cookie_jar=aiohttp.DummyCookieJar(),
                                                  timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT_S))
        return self._session

    async def _call(self, method: str, endpoint: str, **kwargs: Any) -> bytes:
        with translated_errors(self.name, endpoint):
            async with self._client().request(method, self._base + endpoint, **kwargs) as resp:
                raw = await resp.read()
                if not 200 <= resp.status < 300:
                    raise http_error(resp.status, resp.headers, raw)
                return raw

    async def _json(self, method: str, endpoint: str, **kwargs: Any) -> dict[str, Any]:
        data = decode_json(await self._call(method, endpoint, **kwargs))
        if not isinstance(data, dict) or not isinstance(data.get("id"), str):
            raise UpstreamBadResponse(f"upstream {endpoint} answered without an object id")
        return data

    async def upload(self, data: bytes, *, filename: str) -> str:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", data, filename=filename, content_type="application/jsonl")
        return (await self._json("POST", "/files", data=form))["id"]

    async def create_batch(self, input_file_id: str, *, endpoint: str, completion_window: str) -> dict[str, Any]:
        body = {"input_file_id": input_file_id, "endpoint": endpoint, "completion_window": completion_window}
        return await self._json("POST", "/batches", json=body)

    async def retrieve_batch(self, batch_id: str) -> dict[str, Any]:
        return await self._json("GET", f"/batches/{batch_id}")

    async def cancel_batch(self, batch_id: str) -> dict[str, Any]:
        return await self._json("POST", f"/batches/{batch_id}/cancel")

    async def content(self, file_id: str) -> bytes:
        return await self._call("GET", f"/files/{file_id}/content")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
