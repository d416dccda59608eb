"""`mergebroker mcp`: the broker as an MCP server (the official `mcp` SDK), over stdio or streamable HTTP.

Tools: `chat`, `embed`, `count_tokens`, `broker_stats`. Each call goes through a `ToolBackend` (the broker
in this process, or a running one with `--broker URL`), so concurrent agent calls are merged and coalesced
with the rest of their tenant's traffic in their tier. A refused or failed call comes back as a tool
error (`is_error`) carrying the broker's status, type, code and message; the server itself keeps serving.

Every tool first checks the key the server calls with, as the broker checks it (`ToolBackend.authenticate`):
where the broker wants a key, a server without one (or with a wrong one) answers every tool with the 401,
`count_tokens` and `broker_stats` included.

Embeddings larger than `mcp.max_inline_values` floats in all are not pasted into the agent's context:
the tool returns a handle, `mergebroker://embeddings/{handle}`, and its pages,
`mergebroker://embeddings/{handle}/pages/{n}`, resources the client reads when it needs the vectors, each
small enough for the official client over HTTP (`broker.mcp.handles`; the last `mcp.max_handles` are kept).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from mcp.server.mcpserver import MCPServer
from mcp.types import CallToolResult, TextContent
from pydantic import Field

from mergebroker.broker.engine.ground.settings import McpSettings
from mergebroker.broker.engine.ground.tokens import count_text_tokens, estimate_prompt_tokens
from mergebroker.broker.library import Reply
from mergebroker.broker.mcp.backend import ToolBackend
from mergebroker.broker.mcp.handles import HANDLE_URI, PAGE_URI, EmbeddingHandles, embed_result
from mergebroker.errors import BrokerError, InvalidRequest

INSTRUCTIONS = ("mergebroker answers chat and embedding calls through a request-merge broker: identical calls "
                "share one answer, similar ones share one upstream call. Use tier 'batch' when you can wait "
                "a little for cheaper calls.")
__all__ = ["HANDLE_URI", "build_server", "chat_result", "count_tokens", "embed_result", "tool_error"]


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
    """The MCP server with its four tools and the embeddings-handle resources, answering through `backend`."""
    server: MCPServer = MCPServer("mergebroker", instructions=INSTRUCTIONS)
    handles = EmbeddingHandles(settings.max_handles, max_bytes=settings.max_handle_bytes)

    async def answer(work: Callable[[], Awaitable[CallToolResult]]) -> CallToolResult:
        """`work`'s result once the key is accepted; any refusal or failure as a tool error."""
        try:
            await backend.authenticate()
            return await work()
        except BrokerError as exc:
            return tool_error(exc)

    @server.tool(description="Ask a chat model through the broker. Returns the answer text; structured content "
                             "has the broker's headers (batch size, cache), the usage and the finish reason.")
    async def chat(messages: Annotated[list[dict[str, Any]], Field(description="OpenAI chat messages")],
                   model: str, tier: str | None = None, max_tokens: int | None = None) -> CallToolResult:
        body: dict[str, Any] = {"model": model, "messages": messages}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens

        async def work() -> CallToolResult:
            return chat_result(await backend.chat(body, tier))
        return await answer(work)

    @server.tool(description="Embed texts through the broker's caches and batching. Returns the vectors, or a "
                             "handle and its pages to read them by when they are too large to return inline.")
    async def embed(texts: list[str], model: str = settings.embedding_model,
                    tier: str | None = None) -> CallToolResult:
        async def work() -> CallToolResult:
            reply = await backend.embeddings({"model": model, "input": texts}, tier)
            return embed_result(reply, handles, settings.max_inline_values)
        return await answer(work)

    @server.tool(name="count_tokens", description="Count the tokens of a text, or of chat messages as a prompt.")
    async def count(text: str | None = None, messages: list[dict[str, Any]] | None = None) -> CallToolResult:
        async def work() -> CallToolResult:
            counted = count_tokens(text, messages)
            return CallToolResult(content=[TextContent(type="text", text=str(counted["tokens"]))],
                                  structured_content=counted)
        return await answer(work)

    @server.tool(description="The broker's figures: per tier the merge rate, mean batch size and queue depth; the "
                             "chat cache's hit rate and coalesced ratio; the embedding coalescer's cache-hit rate, "
                             "coalesced ratio, mean batch size and pending-window count.")
    async def broker_stats() -> CallToolResult:
        async def work() -> CallToolResult:
            stats = await backend.stats()
            return CallToolResult(content=[TextContent(type="text", text=json.dumps(stats))],
                                  structured_content=stats)
        return await answer(work)

    add_handle_resources(server, handles)
    return server


def add_handle_resources(server: MCPServer, handles: EmbeddingHandles) -> None:
    """The resources large embed results are read by: whole (while one page) or page by page."""

    @server.resource(HANDLE_URI, mime_type="application/json",
                     description="Vectors of a large embed call, while they fit one page.")
    def embeddings_by_handle(handle: str) -> str:
        return handles.whole(handle)

    @server.resource(PAGE_URI, mime_type="application/json",
                     description="One page of a large embed call's vectors, in order (the pages joined are all).")
    def embeddings_page(handle: str, page: str) -> str:
        return handles.page(handle, page)
