"""`mergebroker mcp`: the broker as an MCP server (the official `mcp` SDK), over stdio or streamable HTTP.

Tools: `chat`, `embed`, `count_tokens`, `broker_stats`. Each call goes through a `ToolBackend` (the broker
in this process, or a running one with `--broker URL`), so concurrent agent calls are merged and coalesced
with the rest of their tenant's traffic in their tier. A refused or failed call comes back as a tool
error (`is_error`) carrying the broker's status, type, code and message; the server itself keeps serving.

Embeddings larger than `mcp.max_inline_values` floats in all are not pasted into the agent's context:
the tool returns a handle, `mergebroker://embeddings/{handle}`, a resource the client reads when it needs
the vectors (the last `mcp.max_handles` are kept).
"""

from __future__ import annotations

import json
import secrets
from collections import OrderedDict
from typing import Annotated, Any

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ResourceError
from mcp.types import CallToolResult, TextContent
from pydantic import Field

from mergebroker.broker.library import Reply
from mergebroker.broker.mcp.backend import ToolBackend
from mergebroker.broker.engine.settings import McpSettings
from mergebroker.broker.engine.tokens import count_text_tokens, estimate_prompt_tokens
from mergebroker.errors import BrokerError, InvalidRequest

INSTRUCTIONS = ("mergebroker answers chat and embedding calls through a request-merge broker: identical calls "
                "share one answer, similar ones share one upstream call. Use tier 'batch' when you can wait "
                "a little for cheaper calls.")
HANDLE_URI = "mergebroker://embeddings/{handle}"


def tool_error(exc: BrokerError) -> CallToolResult:
    """A tool error carrying the broker's error envelope (and its HTTP status)."""
    error = {**exc.body()["error"], "status": exc.status}
    text = f"{exc.status} {exc.code or exc.type}: {exc.message}"
    return CallToolResult(content=[TextContent(type="text", text=text)], structured_content={"error": error},
                          is_error=True)


def chat_result(reply: Reply) -> CallToolResult:
    """The answer text, with the broker's headers and the usage as structured content."""
    choice = (reply.body.get("choices") or [{}])[0]
    text = (choice.get("message") or {}).get("content") or ""
    structured = {"text": text, "model": reply.body.get("model"), "finish_reason": choice.get("finish_reason"),
                  "batch_size": int(reply.headers.get("X-Broker-Batch-Size", "1")),
                  "cache": reply.headers.get("X-Broker-Cache"), "usage": reply.body.get("usage"),
                  "headers": reply.headers}
    return CallToolResult(content=[TextContent(type="text", text=text)], structured_content=structured)


class EmbeddingHandles:
    """The vectors of the last `capacity` embed calls too large to return inline, by handle."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._vectors: OrderedDict[str, list[list[float]]] = OrderedDict()

    def keep(self, vectors: list[list[float]]) -> str:
        """A new handle for `vectors`; the oldest handle is forgotten past the capacity."""
        handle = "emb_" + secrets.token_hex(8)
        self._vectors[handle] = vectors
        while len(self._vectors) > self._capacity:
            self._vectors.popitem(last=False)
        return handle

    def get(self, handle: str) -> list[list[float]]:
        """The vectors of `handle`; `ResourceError` when unknown or forgotten."""
        if handle not in self._vectors:
            raise ResourceError(f"Unknown or expired embeddings handle '{handle}'.")
        return self._vectors[handle]


def embed_result(reply: Reply, handles: EmbeddingHandles, max_inline_values: int) -> CallToolResult:
    """Vectors inline when small enough, else a handle to read them by; usage and headers either way."""
    vectors = [item["embedding"] for item in reply.body["data"]]
    size = sum(len(v) for v in vectors)
    structured: dict[str, Any] = {"count": len(vectors), "dimensions": len(vectors[0]) if vectors else 0,
                                  "cache": reply.headers.get("X-Broker-Cache"), "usage": reply.body.get("usage"),
                                  "headers": reply.headers}
    if size <= max_inline_values:
        structured["vectors"] = vectors
        text = f"{len(vectors)} vectors of {structured['dimensions']} dimensions (in structured content)."
    else:
        structured["handle"] = HANDLE_URI.format(handle=handles.keep(vectors))
        text = (f"{len(vectors)} vectors of {structured['dimensions']} dimensions: too large to return inline "
                f"({size} values > {max_inline_values}); read the resource {structured['handle']}.")
    return CallToolResult(content=[TextContent(type="text", text=text)], structured_content=structured)


def count_tokens(text: str | None = None, messages: list[dict[str, Any]] | None = None) -> dict[str, int]:
    """Tokens of a text, or of a chat prompt (messages with the per-message framing), as the broker counts them."""
    if (text is None) == (messages is None):
        raise InvalidRequest("Give exactly one of 'text' or 'messages'.", param="text")
    if text is not None:
        return {"tokens": count_text_tokens(text)}
    if not all(isinstance(m, dict) for m in messages or []):
        raise InvalidRequest("Each message must be an object with 'role' and 'content'.", param="messages")
    return {"tokens": estimate_prompt_tokens(messages or [])}


def build_server(backend: ToolBackend, settings: McpSettings) -> MCPServer:
    """The MCP server with its four tools and the embeddings-handle resource, answering through `backend`."""
    server: MCPServer = MCPServer("mergebroker", instructions=INSTRUCTIONS)
    handles = EmbeddingHandles(settings.max_handles)

    @server.tool(description="Ask a chat model through the broker. Returns the answer text; structured content "
                             "has the broker's headers (batch size, cache), the usage and the finish reason.")
    async def chat(messages: Annotated[list[dict[str, Any]], Field(description="OpenAI chat messages")],
                   model: str, tier: str | None = None, max_tokens: int | None = None) -> CallToolResult:
        body: dict[str, Any] = {"model": model, "messages": messages}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        try:
            return chat_result(await backend.chat(body, tier))
        except BrokerError as exc:
            return tool_error(exc)

    @server.tool(description="Embed texts through the broker's caches and batching. Returns the vectors, or a "
                             "handle to read them by when they are too large to return inline.")
    async def embed(texts: list[str], model: str = settings.embedding_model,
                    tier: str | None = None) -> CallToolResult:
        try:
            reply = await backend.embeddings({"model": model, "input": texts}, tier)
        except BrokerError as exc:
            return tool_error(exc)
        return embed_result(reply, handles, settings.max_inline_values)

    @server.tool(name="count_tokens", description="Count the tokens of a text, or of chat messages as a prompt.")
    def count(text: str | None = None, messages: list[dict[str, Any]] | None = None) -> CallToolResult:
        try:
            counted = count_tokens(text, messages)
        except BrokerError as exc:
            return tool_error(exc)
        return CallToolResult(content=[TextContent(type="text", text=str(counted["tokens"]))],
                              structured_content=counted)

    @server.tool(description="The broker's figures: per tier the merge rate, mean batch size and queue depth; the "
                             "chat cache's hit rate and coalesced ratio; the embedding coalescer's cache-hit rate, "
                             "coalesced ratio, mean batch size and pending-window count.")
    async def broker_stats() -> CallToolResult:
        try:
            stats = await backend.stats()
        except BrokerError as exc:
            return tool_error(exc)
        return CallToolResult(content=[TextContent(type="text", text=json.dumps(stats))], structured_content=stats)

    @server.resource(HANDLE_URI, mime_type="application/json", description="Vectors of a large embed call.")
    def embeddings_by_handle(handle: str) -> str:
        return json.dumps(handles.get(handle))

    return server
