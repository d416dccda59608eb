"""The simulator's Azure OpenAI mode: the OpenAI endpoints on Azure's deployment paths.

`POST /openai/deployments/{deployment}/chat/completions` and `.../embeddings` answer exactly as the
OpenAI endpoints do (same `Simulator`, same answers, faults and counters), after Azure's own checks:
the `api-version` query parameter is required (404 "Resource not found" without it, as Azure
answers), an `api-key` header (or a Bearer token) is required (401), and the deployment must be one
of the simulator's model names (404 `DeploymentNotFound`). `GET /openai/models` lists the models.
The official `openai` SDK's `AzureOpenAI` client drives this mode in a test.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from aiohttp import web

from mergebroker.providers.simulator.faults import SimulatorConfig, error_response

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Simulator(Protocol):
    """What this mode uses of `providers.simulator.server.Simulator`: its config and its OpenAI handlers."""

    @property
    def config(self) -> SimulatorConfig: ...

    async def chat(self, request: web.Request) -> web.StreamResponse: ...

    async def embeddings(self, request: web.Request) -> web.StreamResponse: ...

    async def models(self, request: web.Request) -> web.StreamResponse: ...

_ACCESS_DENIED = ("Access denied due to invalid subscription key or wrong API endpoint. Make sure to provide a "
                  "valid key for an active subscription and use a correct regional API endpoint for your resource.")
_NO_DEPLOYMENT = ("The API deployment for this resource does not exist. If you created the deployment within the "
                  "last 5 minutes, please wait a moment and try again.")


def azure_refusal(request: web.Request, models: tuple[str, ...]) -> web.Response | None:
    """Azure's answer to a call it refuses before the model sees it, or None to go on."""
    if not request.query.get("api-version"):
        return error_response(404, "Resource not found", "invalid_request_error", "404")
    if not request.headers.get("api-key") and not request.headers.get("Authorization", "").startswith("Bearer "):
        return error_response(401, _ACCESS_DENIED, "invalid_request_error", "401")
    deployment = request.match_info.get("deployment")
    if deployment is not None and deployment not in models:
        return error_response(404, _NO_DEPLOYMENT, "invalid_request_error", "DeploymentNotFound")
    return None


class AzureMode:
    """Azure's paths in front of one `Simulator`'s OpenAI handlers."""

    def __init__(self, simulator: Simulator) -> None:
        self._sim = simulator

    def _checked(self, handler: Handler) -> Handler:
        async def checked(request: web.Request) -> web.StreamResponse:
            refusal = azure_refusal(request, self._sim.config.models)
            return refusal if refusal is not None else await handler(request)

        return checked

    def routes(self) -> list[web.RouteDef]:
        """The deployment-scoped chat and embeddings routes and the models list."""
        sim = self._sim
        prefix = "/openai/deployments/{deployment}"
        return [web.post(prefix + "/chat/completions", self._checked(sim.chat)),
                web.post(prefix + "/embeddings", self._checked(sim.embeddings)),
                web.get("/openai/models", self._checked(sim.models))]


def azure_routes(simulator: Simulator) -> list[web.RouteDef]:
    """The Azure mode's routes for `simulator`."""
    return AzureMode(simulator).routes()
