"""Azure OpenAI: the simulator's Azure mode answers the official `AzureOpenAI` client, and the Azure provider
calls deployment paths with `api-version` and an `api-key` header (never a Bearer token)."""

from __future__ import annotations

import aiohttp
import openai
import pytest
from aiohttp import web

from mergebroker.errors import UpstreamHTTPError
from mergebroker.providers.openai.azure import AzureOpenAIProvider
from mergebroker.providers.openai.compat import HttpProviderSettings
from mergebroker.providers.simulator.server import answer_for

API_VERSION = "2024-10-21"


@pytest.fixture
async def azure_sdk(simulator):
    client = openai.AsyncAzureOpenAI(azure_endpoint=simulator.url.removesuffix("/v1"), api_key="az-key",
                                     api_version=API_VERSION, max_retries=0)
    try:
        yield client
    finally:
        await client.close()


async def test_the_azure_sdk_gets_chat_streams_and_embeddings(azure_sdk, simulator):
    reply = await azure_sdk.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": "Hi"}])
    assert reply.choices[0].message.content == answer_for("Hi")
    stream = await azure_sdk.chat.completions.create(model="sim-small", stream=True,
                                                     messages=[{"role": "user", "content": "Hi"}])
    assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == answer_for("Hi")
    vectors = await azure_sdk.embeddings.create(model="sim-embed", input=["a", "b"])
    assert len(vectors.data) == 2
    assert simulator.stats()["chat_calls"] == 2 and simulator.stats()["embedding_calls"] == 1


async def test_azure_refuses_unknown_deployments_missing_versions_and_missing_keys(azure_sdk, simulator):
    with pytest.raises(openai.NotFoundError) as info:
        await azure_sdk.chat.completions.create(model="gpt-nowhere", messages=[{"role": "user", "content": "Hi"}])
    assert info.value.body["code"] == "DeploymentNotFound"
    base = simulator.url.removesuffix("/v1") + "/openai/deployments/sim-small/chat/completions"
    body = {"messages": [{"role": "user", "content": "Hi"}]}
    async with aiohttp.ClientSession() as http:
        async with http.post(base, json=body, headers={"api-key": "k"}) as resp:
            assert resp.status == 404  # Azure's answer to a missing api-version
        async with http.post(base, params={"api-version": API_VERSION}, json=body) as resp:
            assert resp.status == 401
    assert simulator.stats()["chat_calls"] == 0


@pytest.fixture
async def recorder():
    """A loopback server that records each request's path, query and headers and answers like OpenAI."""
    seen: list[web.Request] = []

    async def handle(request: web.Request) -> web.Response:
        seen.append(request)
        if request.path.endswith("/embeddings"):
            return web.json_response({"object": "list", "data": [{"index": 0, "embedding": [1.0]}]})
        if request.path.endswith("/models"):
            return web.json_response({"object": "list", "data": [{"id": "gpt-4o-2024-08-06"}]})
        if "/busy/" in request.path:
            return web.json_response({"error": {"code": "429", "message": "slow down"}}, status=429,
                                     headers={"Retry-After": "4"})
        return web.json_response({"choices": [{"index": 0, "message": {"content": "ok"}}]})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", seen
    await runner.cleanup()


async def test_the_provider_calls_deployment_paths_with_api_version_and_api_key(recorder):
    url, seen = recorder
    provider = AzureOpenAIProvider(HttpProviderSettings(name="az", base_url=url, api_key="secret"),
                                   api_version="2099-01-01", deployments={"gpt-4o": "prod 4o", "emb": "e-1"})
    try:
        await provider.chat({"model": "gpt-4o", "messages": []}, timeout=5)
        await provider.chat({"model": "gpt-4o-mini", "messages": []}, timeout=5)
        await provider.embeddings({"model": "emb", "input": "x"}, timeout=5)
        models = await provider.list_models(timeout=5)
    finally:
        await provider.close()
    assert [r.path for r in seen] == ["/openai/deployments/prod 4o/chat/completions",
                                      "/openai/deployments/gpt-4o-mini/chat/completions",
                                      "/openai/deployments/e-1/embeddings", "/openai/models"]
    assert all(r.query["api-version"] == "2099-01-01" for r in seen)
    assert all(r.headers["api-key"] == "secret" and "Authorization" not in r.headers for r in seen)
    assert models == ["emb", "gpt-4o"]  # the configured deployments, not the resource's base models


async def test_provider_errors_map_as_for_any_openai_upstream(recorder):
    url, _ = recorder
    provider = AzureOpenAIProvider(HttpProviderSettings(name="az", base_url=url, api_key="k"))
    try:
        with pytest.raises(UpstreamHTTPError) as info:
            await provider.chat({"model": "busy", "messages": []}, timeout=5)
    finally:
        await provider.close()
    assert info.value.status == 429 and info.value.retry_after == 4.0 and info.value.retryable
