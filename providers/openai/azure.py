"""One Azure OpenAI resource: the OpenAI API on deployment paths, with `api-version` and an `api-key` header.

Bodies and answers are OpenAI's, so everything but the URL and the key header is `OpenAICompatProvider`'s.
A call for model M goes to `{base_url}/openai/deployments/{deployments[M]}/...?api-version=V`; a model
missing from `deployments` is taken to be deployed under its own name (Azure's usual convention).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from yarl import URL

from mergebroker.providers.openai.compat import HttpProviderSettings, OpenAICompatProvider

AZURE_API_VERSION = "2024-10-21"
"""The data-plane inference GA version used when none is configured."""

_MAX_CACHED_URLS = 1024  # model names come from callers: keep the memo bounded


class AzureOpenAIProvider(OpenAICompatProvider):
    """A `providers.base.Provider` for one Azure OpenAI resource (`base_url` "https://NAME.openai.azure.com").

    `api_key` travels as the `api-key` header; `deployments` maps the callers' model names to
    deployment names. `list_models` lists the configured deployments' model names when there are
    some, else the models the resource reports (`GET /openai/models`).
    """

    def __init__(self, settings: HttpProviderSettings, *, api_version: str = AZURE_API_VERSION,
                 deployments: Mapping[str, str] | None = None) -> None:
        headers = settings.extra_headers + ((("api-key", settings.api_key),) if settings.api_key else ())
        super().__init__(replace(settings, api_key=None, extra_headers=headers))
        self._api_version = api_version
        self._deployments = dict(deployments or {})
        self._deployment_urls: dict[tuple[str, str], URL] = {}
        self.native_apis = frozenset()  # deployments are addressed per chat route: Responses is translated

    def __repr__(self) -> str:
        return f"AzureOpenAIProvider(name={self.name!r}, base_url={self._base_url!r})"

    def deployment_for(self, model: str) -> str:
        """The deployment that serves `model`."""
        return self._deployments.get(model, model)

    def _endpoint_url(self, endpoint: str, body: dict[str, Any] | None) -> URL | str:
        model = str((body or {}).get("model") or "")
        key = (endpoint, model)
        url = self._deployment_urls.get(key)
        if url is None:
            base = URL(self._base_url) / "openai"
            if body is not None:
                base = base / "deployments" / self.deployment_for(model)
            url = base.joinpath(*endpoint.strip("/").split("/")).with_query({"api-version": self._api_version})
            if len(self._deployment_urls) < _MAX_CACHED_URLS:
                self._deployment_urls[key] = url
        return url

    async def list_models(self, *, timeout: float) -> list[str]:
        """The deployments' model names, or the resource's models when no deployment is configured."""
        models = await super().list_models(timeout=timeout)  # a real call: checks the key, warms a connection
        return sorted(self._deployments) or models
