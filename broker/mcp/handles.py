"""Large embed results kept by handle and read back in pages that fit the official MCP client's limits.

The SDK's HTTP client refuses a server-sent event over 1 MiB, and 2,048 vectors of 384 floats are about
15 MB of JSON, so a handle's vectors are cut into pages of at most `PAGE_BYTES` of JSON each, in order:
`mergebroker://embeddings/{handle}/pages/{n}` is the JSON list of page n's vectors, and the pages joined
are every vector. The handle's own URI reads the whole list while it fits one page. Pages are kept as JSON
text (a float in a Python list costs about four times its text), the last `capacity` handles and at most
`max_bytes` in all, the oldest forgotten first.
"""

from __future__ import annotations

import json
import secrets
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from mcp.server.mcpserver.exceptions import ResourceError
from mcp.types import CallToolResult, TextContent

from mergebroker.broker.library import Reply

HANDLE_URI = "mergebroker://embeddings/{handle}"
PAGE_URI = "mergebroker://embeddings/{handle}/pages/{page}"
PAGE_BYTES = 512 * 1024
"""JSON per page: half the client's 1 MiB event limit, leaving room for the JSON-RPC envelope."""
"""JSON text all kept handles may hold together; wants an `mcp.max_handle_bytes` setting."""


@dataclass(frozen=True)
class _Kept:
    pages: tuple[str, ...]  # each a JSON list of vectors
    size: int


class EmbeddingHandles:
    """The vectors of the last `capacity` embed calls too large to return inline, by handle, in pages."""

    def __init__(self, capacity: int, *, max_bytes: int, page_bytes: int = PAGE_BYTES) -> None:
        self._capacity = capacity
        self._page_bytes = page_bytes
        self._max_bytes = max_bytes
        self._kept: OrderedDict[str, _Kept] = OrderedDict()
        self._size = 0

    def keep(self, vectors: list[list[float]]) -> tuple[str, int]:
        """A new handle for `vectors` and how many pages they fill; the oldest handles are forgotten past the
        capacity or the byte budget."""
        handle = "emb_" + secrets.token_hex(8)
        pages = paginate(vectors, self._page_bytes)
        kept = _Kept(tuple(pages), sum(len(p) for p in pages))
        self._kept[handle] = kept
        self._size += kept.size
        while len(self._kept) > self._capacity or (self._size > self._max_bytes and len(self._kept) > 1):
            _, dropped = self._kept.popitem(last=False)
            self._size -= dropped.size
        return handle, len(pages)

    def whole(self, handle: str) -> str:
        """Every vector of `handle` as one JSON list, while they fit one page."""
        kept = self._get(handle)
        if len(kept.pages) > 1:
            raise ResourceError(f"The vectors of '{handle}' fill {len(kept.pages)} pages: read "
                                f"{PAGE_URI.format(handle=handle, page='{n}')} for n from 0 to {len(kept.pages) - 1}.")
        return kept.pages[0]

    def page(self, handle: str, page: str) -> str:
        """Page `page` of `handle`'s vectors, as a JSON list."""
        kept = self._get(handle)
        if not page.isdigit() or int(page) >= len(kept.pages):
            raise ResourceError(f"'{handle}' has pages 0 to {len(kept.pages) - 1}, not {page[:20]!r}.")
        return kept.pages[int(page)]

    def _get(self, handle: str) -> _Kept:
        kept = self._kept.get(handle)
        if kept is None:
            raise ResourceError(f"Unknown or expired embeddings handle '{handle}'.")
        return kept


def paginate(vectors: list[list[float]], page_bytes: int) -> list[str]:
    """`vectors` as JSON lists of at most `page_bytes` each (a vector larger than a page is a page alone)."""
    pages: list[str] = []
    items: list[str] = []
    size = 2
    for vector in vectors:
        text = json.dumps(vector)
        if items and size + len(text) + 1 > page_bytes:
            pages.append("[" + ",".join(items) + "]")
            items, size = [], 2
        items.append(text)
        size += len(text) + 1
    pages.append("[" + ",".join(items) + "]")
    return pages


def embed_result(reply: Reply, handles: EmbeddingHandles, max_inline_values: int) -> CallToolResult:
    """Vectors inline when small enough, else a handle and its pages to read them by; usage and headers
    either way."""
    vectors = [item["embedding"] for item in reply.body["data"]]
    size = sum(len(v) for v in vectors)
    dimensions = len(vectors[0]) if vectors else 0
    structured: dict[str, Any] = {"count": len(vectors), "dimensions": dimensions,
                                  "cache": reply.headers.get("X-Broker-Cache"), "usage": reply.body.get("usage"),
                                  "headers": reply.headers}
    if size <= max_inline_values and len(json.dumps(vectors)) <= PAGE_BYTES:
        structured["vectors"] = vectors
        text = f"{len(vectors)} vectors of {dimensions} dimensions (in structured content)."
    else:
        handle, pages = handles.keep(vectors)
        structured["handle"] = HANDLE_URI.format(handle=handle)
        structured["pages"] = [PAGE_URI.format(handle=handle, page=n) for n in range(pages)]
        text = (f"{len(vectors)} vectors of {dimensions} dimensions: too large to return inline ({size} values); "
                f"read them in order from the {pages} page resources in structured content 'pages' "
                f"({structured['pages'][0]} ...).")
    return CallToolResult(content=[TextContent(type="text", text=text)], structured_content=structured)
