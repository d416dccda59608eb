"""Large embed results are kept in pages small enough for the official MCP client, within a byte budget; the
HTTP transport listens beyond loopback only with a token (issue 26: finding 9)."""

from __future__ import annotations

import json
import random

import pytest
from mcp.server.mcpserver.exceptions import ResourceError

from mergebroker.broker.mcp.handles import EmbeddingHandles, paginate
from mergebroker.broker.mcp.http_transport import bind_check, is_loopback


def vectors(n: int, dims: int = 384) -> list[list[float]]:
    rng = random.Random(n)
    return [[rng.uniform(-1, 1) for _ in range(dims)] for _ in range(n)]


def test_pages_hold_every_vector_in_order_each_within_the_page_size():
    given = vectors(300)
    pages = paginate(given, 64 * 1024)
    assert len(pages) > 1 and all(len(p) <= 64 * 1024 for p in pages)
    assert [v for p in pages for v in json.loads(p)] == given


def test_handles_read_whole_or_by_page_and_forget_the_oldest_past_the_byte_budget():
    handles = EmbeddingHandles(10, page_bytes=64 * 1024, max_bytes=2 * 1024 * 1024)
    small, _ = handles.keep(vectors(2))
    large, pages = handles.keep(vectors(100))
    assert json.loads(handles.whole(small)) == vectors(2)
    with pytest.raises(ResourceError, match="pages"):
        handles.whole(large)
    assert [v for n in range(pages) for v in json.loads(handles.page(large, str(n)))] == vectors(100)
    with pytest.raises(ResourceError):
        handles.page(large, str(pages))
    for _ in range(3):  # about 2.3 MB of JSON more: past the 2 MB budget
        handles.keep(vectors(100))
    with pytest.raises(ResourceError, match="Unknown or expired"):
        handles.whole(small)


@pytest.mark.parametrize("host, token, allowed", [("127.0.0.1", None, True), ("::1", None, True),
                                                  ("localhost", None, True), ("0.0.0.0", None, False),
                                                  ("", None, False), ("mcp.example.org", None, False),
                                                  ("0.0.0.0", "secret", True)])
def test_the_http_transport_binds_beyond_loopback_only_with_a_token(host, token, allowed):
    refusal = bind_check(host, token, token_env="MB_TEST_TOKEN")
    assert (refusal is None) == allowed
    assert refusal is None or "$MB_TEST_TOKEN" in refusal  # it names the variable `mcp.http_token_env` names
    assert is_loopback(host) == (host in ("127.0.0.1", "::1", "localhost"))
