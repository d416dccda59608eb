"""`mergebroker mcp` as a real process, called with the MCP SDK's own client over stdio and streamable HTTP,
running the broker embedded or calling a real `mergebroker serve` process, against the simulated upstream."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import httpx2
import pytest
import yaml
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from tests.conftest import free_port, provider_for
from tests.helpers.processes import wait_for_port

pytestmark = pytest.mark.timeout(120)

KEY = "sk-mcp-test-key"
TOOLS = {"chat", "embed", "count_tokens", "broker_stats"}
# The batch tier closes a window only when it is full (a minute-long window): 20 calls are exactly 5 batches.
TIERS = [{"name": "standard", "window_ms": 60_000, "max_batch": 4, "similarity_threshold": 0.0},
         {"name": "batch", "priority": 0, "window_ms": 60_000, "max_batch": 4, "similarity_threshold": 0.0}]


def _config(tmp_path: Path, sim, **extra) -> Path:
    config = {"providers": [provider_for(sim, models=["sim-small", "sim-embed"])], "merge": {"embedder": "none"},
              "tiers": TIERS, "logging": {"level": "warning"}, **extra}
    path = tmp_path / f"config-{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _env(**extra: str | None) -> dict[str, str]:
    """The child's environment: the test key unless `MERGEBROKER_API_KEY=None` removes it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MERGEBROKER_")}
    env = {**env, "MERGEBROKER_API_KEY": KEY, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **extra}
    return {k: v for k, v in env.items() if v is not None}


@contextlib.asynccontextmanager
async def _process(args: list[str], port: int, log: Path, env: dict[str, str] | None = None) -> AsyncIterator[None]:
    """A `mergebroker` command running until the block ends, once it listens on `port`."""
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mergebroker.broker.cli", *args], env=env or _env(),
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        await wait_for_port(port, proc=proc, log=log)
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@contextlib.asynccontextmanager
async def _client(transport: str, mcp_args: list[str], tmp_path: Path,
                  env: dict[str, str] | None = None) -> AsyncIterator[Client]:
    """The SDK's client of a `mergebroker mcp` process over `transport`."""
    if transport == "stdio":
        params = StdioServerParameters(command=sys.executable, env=env or _env(),
                                       args=["-m", "mergebroker.broker.cli", "mcp", *mcp_args])
        async with Client(params, read_timeout_seconds=60) as client:
            yield client
        return
    port = free_port()
    async with _process(["mcp", *mcp_args, "--transport", "http", "--port", str(port)], port, tmp_path / "mcp.log"):
        async with Client(f"http://127.0.0.1:{port}/mcp", read_timeout_seconds=60) as client:
            yield client


@contextlib.asynccontextmanager
async def _mcp(mode: str, transport: str, sim, tmp_path: Path, **config) -> AsyncIterator[Client]:
    """An MCP client of the broker: embedded in the MCP process, or a `mergebroker serve` it calls."""
    if mode == "embedded":
        async with _client(transport, ["--config", str(_config(tmp_path, sim, **config))], tmp_path) as client:
            yield client
        return
    port = free_port()
    serve = ["serve", "--config", str(_config(tmp_path, sim, **config)), "--port", str(port)]
    async with _process(serve, port, tmp_path / "serve.log"):
        async with _client(transport, ["--broker", f"http://127.0.0.1:{port}"], tmp_path) as client:
            yield client


def _chat(i: int, tier: str = "batch") -> dict:
    return {"messages": [{"role": "user", "content": f"Agent question number {i}?"}], "model": "sim-small",
            "tier": tier}


@pytest.mark.parametrize("transport", ["stdio", "http"])
@pytest.mark.parametrize("mode", ["embedded", "broker"])
async def test_concurrent_agent_calls_merge_and_bad_arguments_are_tool_errors(mode, transport, simulator, tmp_path):
    """20 concurrent batch-tier chats take at most 5 upstream calls; a bad argument is a clean tool error."""
    async with _mcp(mode, transport, simulator, tmp_path) as client:
        tools = {tool.name for tool in (await client.list_tools()).tools}
        results = await asyncio.gather(*(client.call_tool("chat", _chat(i)) for i in range(20)))
        bad = await client.call_tool("chat", {"messages": [], "model": "sim-small"})
        unknown = await client.call_tool("chat", {**_chat(0), "model": "no-such-model"})
        after = await client.call_tool("count_tokens", {"text": "the server still serves"})
        stats = (await client.call_tool("broker_stats", {})).structured_content
    assert tools == TOOLS
    assert not any(r.is_error for r in results) and all(r.content[0].text for r in results)
    assert [r.structured_content["batch_size"] for r in results] == [4] * 20
    assert simulator.stats()["chat_calls"] <= 5
    assert bad.is_error and bad.structured_content["error"]["code"] == "invalid_value"
    assert bad.structured_content["error"]["status"] == 400 and "messages" in bad.content[0].text
    assert unknown.is_error and unknown.structured_content["error"]["code"] == "model_not_found"
    assert not after.is_error and after.structured_content["tokens"] > 0
    assert stats["tiers"]["batch"]["batches"] == 5 and stats["tiers"]["batch"]["mean_batch_size"] == 4.0


async def test_embed_coalesces_and_large_results_come_back_as_a_handle(simulator, tmp_path):
    """Concurrent embeds of one text cost one upstream call; past the cap the vectors are a readable resource."""
    config = {"embeddings": {"window_ms": 60_000, "max_batch_size": 1}, "mcp": {"max_inline_values": 1000}}
    async with _mcp("embedded", "stdio", simulator, tmp_path, **config) as client:
        small = await asyncio.gather(*(client.call_tool("embed", {"texts": ["one text"], "model": "sim-embed"})
                                       for _ in range(10)))
        large = await client.call_tool("embed", {"texts": ["a", "b", "c"], "model": "sim-embed"})
        read = await client.read_resource(large.structured_content["handle"])
        stats = (await client.call_tool("broker_stats", {})).structured_content["embeddings"]
    assert simulator.stats()["embedding_calls"] == 1 + 3
    assert all(r.structured_content["vectors"] == small[0].structured_content["vectors"] for r in small)
    assert "vectors" not in large.structured_content and large.structured_content["dimensions"] == 384
    assert len(json.loads(read.contents[0].text)) == 3
    assert stats["texts"] == 13 and stats["cached"] + stats["coalesced"] == 9


async def test_the_callers_key_decides_tenant_and_tiers(simulator, tmp_path):
    """With keys, a tier the key may not use is a 403 tool error; the allowed tier is served."""
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    auth = {"mode": "keys", "keys": [{"sha256": digest, "tenant": "agents", "tiers": ["batch"]}]}
    tiers = [{"name": "standard"}, {"name": "batch", "window_ms": 0}]
    async with _mcp("broker", "stdio", simulator, tmp_path, auth=auth, tiers=tiers) as client:
        refused = await client.call_tool("chat", _chat(0, tier="standard"))
        served = await client.call_tool("chat", {**_chat(1), "max_tokens": 16})
    assert refused.is_error and refused.structured_content["error"]["status"] == 403
    assert not served.is_error and served.structured_content["headers"]["X-Broker-Cache"] == "miss"


async def test_an_unreachable_broker_is_a_tool_error_not_a_crash(tmp_path):
    """With nothing listening at --broker, each call is a 502 tool error and the server keeps answering."""
    url = f"http://127.0.0.1:{free_port()}"
    async with _client("stdio", ["--broker", url], tmp_path) as client:
        first = await client.call_tool("chat", _chat(0))
        stats = await client.call_tool("broker_stats", {})
        tokens = await client.call_tool("count_tokens", {"messages": [{"role": "user", "content": "hello"}]})
    assert first.is_error and first.structured_content["error"]["code"] == "broker_unreachable"
    assert stats.is_error and stats.structured_content["error"]["status"] == 502
    assert not tokens.is_error and tokens.structured_content["tokens"] > 0


async def test_a_large_embed_is_read_over_http_in_pages_the_official_client_accepts(simulator, tmp_path):
    """2,048 vectors (about 15 MB of JSON) come back as pages, each under the client's 1 MiB event limit."""
    texts = [f"text number {n}" for n in range(2048)]
    async with _mcp("embedded", "http", simulator, tmp_path) as client:
        large = await client.call_tool("embed", {"texts": texts, "model": "sim-embed"})
        pages = large.structured_content["pages"]
        vectors = []
        for uri in pages:
            vectors += json.loads((await client.read_resource(uri)).contents[0].text)
        small = await client.call_tool("embed", {"texts": texts[:2], "model": "sim-embed"})
    assert not large.is_error and large.structured_content["count"] == 2048 and len(pages) > 1
    assert len(vectors) == 2048 and {len(v) for v in vectors} == {384}
    assert vectors[:2] == small.structured_content["vectors"]


async def test_the_http_transport_serves_only_callers_with_its_token(simulator, tmp_path):
    token = "mcp-transport-token"
    port = free_port()
    args = ["mcp", "--config", str(_config(tmp_path, simulator)), "--transport", "http", "--port", str(port)]
    async with _process(args, port, tmp_path / "mcp.log", env=_env(MERGEBROKER_MCP_TOKEN=token)):
        url = f"http://127.0.0.1:{port}/mcp"
        async with aiohttp.ClientSession() as session:
            for given in (None, "Bearer wrong-token", f"Bearer {token}x", token):
                headers = {"Accept": "application/json, text/event-stream", **({"Authorization": given} if given else {})}
                async with session.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "ping"},
                                        headers=headers) as resp:
                    assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_mcp_token"
        http = create_mcp_http_client(headers={"Authorization": f"Bearer {token}"},
                                      timeout=httpx2.Timeout(60, read=60))
        async with http, Client(streamable_http_client(url, http_client=http), read_timeout_seconds=60) as client:
            counted = await client.call_tool("count_tokens", {"text": "served with the token"})
    assert not counted.is_error and counted.structured_content["tokens"] > 0


def test_without_a_token_the_http_transport_will_not_listen_beyond_loopback(simulator, tmp_path):
    done = subprocess.run([sys.executable, "-m", "mergebroker.broker.cli", "mcp", "--transport", "http", "--host",
                           "0.0.0.0", "--port", str(free_port())], env=_env(), capture_output=True, timeout=60)
    assert done.returncode == 2 and b"MERGEBROKER_MCP_TOKEN" in done.stderr


async def test_without_a_key_no_tool_answers(simulator, tmp_path):
    """In keys mode, a server started without a broker key answers every tool with the broker's 401."""
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    auth = {"mode": "keys", "keys": [{"sha256": digest, "tenant": "agents", "tiers": ["batch", "standard"]}]}
    args = ["--config", str(_config(tmp_path, simulator, auth=auth))]
    async with _client("stdio", args, tmp_path, env=_env(MERGEBROKER_API_KEY=None)) as client:
        results = [await client.call_tool("count_tokens", {"text": "hello"}),
                   await client.call_tool("broker_stats", {}), await client.call_tool("chat", _chat(0)),
                   await client.call_tool("embed", {"texts": ["a"], "model": "sim-embed"})]
    assert [r.is_error for r in results] == [True] * 4
    assert {r.structured_content["error"]["status"] for r in results} == {401}
    assert simulator.stats()["chat_calls"] == 0
