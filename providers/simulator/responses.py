"""The simulator's OpenAI Responses API: `POST /v1/responses`, plain and streamed, with stored responses.

Served in the OpenAI mode beside chat completions (also without the `/v1` prefix): the input and tools are read
by `providers.simulator.responses_input`, the answer composed by `providers.simulator.responses_answer` (the chat
route's content rules and the agent's tool rules), streams sent by `providers.simulator.responses_stream`, and
`store`d responses kept by `providers.simulator.responses_state` for `previous_response_id`,
`GET /v1/responses/{id}`, `DELETE /v1/responses/{id}` and `GET /v1/responses/{id}/input_items`.
Usage is counted and billed as the chat route counts and bills it (the automatic prompt cache of
`providers.simulator.billing` included, its cached tokens in `input_tokens_details.cached_tokens`), and the
call faults, latency and mid-stream errors of `providers.simulator.faults` apply as they do to chat.
With `responses: false` (`--no-responses`) the simulator is a chat-only upstream: these routes answer 404 in
OpenAI's envelope, as many OpenAI-compatible servers do. Calls are counted in `stats.calls["responses"]`
(retrievals, deletions and listings under their own names).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Protocol

from aiohttp import web

from mergebroker.errors import InvalidRequest, NotFound
from mergebroker.providers.simulator.billing import Biller
from mergebroker.providers.simulator.bodies import json_object
from mergebroker.providers.simulator.content import count_tokens, parse_request_blocks, question_text
from mergebroker.providers.simulator.faults import FaultInjector, SimulatorConfig, decide_stream_error
from mergebroker.providers.simulator.responses_answer import Outcome, compose_output, new_id
from mergebroker.providers.simulator.responses_input import check_body, conversation, input_items, text_format, tool_set
from mergebroker.providers.simulator.responses_state import ResponseStore, with_ids
from mergebroker.providers.simulator.responses_stream import failed_events, response_events, send_events, sent_text


class Simulator(Protocol):
    """What this mode uses of `providers.simulator.server.Simulator` (a sibling it extends, private parts too)."""

    stats: Any
    biller: Biller
    _faults: FaultInjector

    @property
    def config(self) -> SimulatorConfig: ...

    def record_request(self, request: web.Request, body: Any) -> None: ...

    async def _injected_fault(self, request: web.Request, *, chat: bool,
                              stream: bool = False) -> web.StreamResponse | None: ...

    async def _pause(self, milliseconds: float) -> None: ...


def responses_usage(usage: Mapping[str, Any], reasoning_tokens: int) -> dict[str, Any]:
    """The Responses API's `usage` for a chat-shaped usage the biller gave."""
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]}


def response_object(body: Mapping[str, Any], outcome: Outcome | None, usage: dict[str, Any] | None) -> dict[str, Any]:
    """The Response the API returns for `body`: its answer (none yet while in progress) and the request's settings
    echoed as OpenAI echoes them."""
    given_reasoning, given_text = body.get("reasoning"), body.get("text")
    reasoning: dict[str, Any] = given_reasoning if isinstance(given_reasoning, dict) else {}
    text: dict[str, Any] = given_text if isinstance(given_text, dict) else {}
    incomplete = outcome is not None and outcome.incomplete
    return {
        "id": new_id("resp"), "object": "response", "created_at": int(time.time()),
        "status": "incomplete" if incomplete else "completed", "background": bool(body.get("background")),
        "error": None, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "max_tool_calls": body.get("max_tool_calls"), "model": body["model"],
        "output": list(outcome.output) if outcome is not None else [],
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"), "prompt_cache_key": body.get("prompt_cache_key"),
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "safety_identifier": body.get("safety_identifier"), "service_tier": body.get("service_tier") or "default",
        "store": body.get("store", True), "temperature": body.get("temperature", 1.0),
        "text": {"format": text.get("format") or {"type": "text"}, "verbosity": text.get("verbosity", "medium")},
        "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
        "top_logprobs": body.get("top_logprobs", 0), "top_p": body.get("top_p", 1.0),
        "truncation": body.get("truncation", "disabled"), "usage": usage, "user": body.get("user"),
        "metadata": body.get("metadata") or {},
    }


class ResponsesMode:
    """The Responses endpoints of one `Simulator` (its config, faults, RNG, counters and bill)."""

    def __init__(self, simulator: Simulator) -> None:
        self._sim = simulator
        self.store = ResponseStore()

    def routes(self) -> list[web.RouteDef]:
        """The routes, with and without the /v1 prefix."""
        table = [("POST", "/responses", self.create), ("GET", "/responses/{id}", self.retrieve),
                 ("DELETE", "/responses/{id}", self.delete), ("GET", "/responses/{id}/input_items", self.input_items)]
        return [web.route(method, prefix + path, handler)
                for prefix in ("", "/v1") for method, path, handler in table]

    def _served(self, request: web.Request) -> None:
        if not self._sim.config.responses:
            raise NotFound(f"Invalid URL ({request.method} {request.path})", code="unknown_url")

    def _stored(self, request: web.Request) -> Any:
        stored = self.store.get(request.match_info["id"])
        if stored is None:
            raise NotFound(f"Response with id '{request.match_info['id']}' not found.", param="response_id",
                           code="not_found")
        return stored

    async def create(self, request: web.Request) -> web.StreamResponse:
        """POST /responses: answer, stream the answer, or inject a fault (see the module docstring)."""
        sim = self._sim
        sim.stats.calls["responses"] += 1
        self._served(request)
        body = await json_object(request)
        sim.record_request(request, body)
        check_body(body)
        items, tools, fmt = with_ids(input_items(body)), tool_set(body), text_format(body)
        prior = self._prior(body.get("previous_response_id"))
        if not prior and not items:
            raise InvalidRequest("Missing required parameter: 'input'.", param="input",
                                 code="missing_required_parameter")
        messages = conversation(body.get("instructions"), prior + items)
        stream, config = bool(body.get("stream")), sim.config
        sim.stats.chat_calls += 1
        sim.stats.stream_calls += int(stream)
        sim.stats.merged_calls += int(bool(messages) and bool(parse_request_blocks(question_text(messages))))
        if (early := await sim._injected_fault(request, chat=True, stream=stream)) is not None:
            return early
        outcome = compose_output(body, prior + items, messages, tools, fmt, config=config, rng=sim._faults.rng)
        sim.stats.record_faults(*outcome.faults)
        response = response_object(body, outcome, None)
        events = response_events(response) if stream else []
        spent = outcome.output_tokens
        if stream and decide_stream_error(config, sim._faults.rng):
            sim.stats.record_faults("stream_error")
            events = failed_events(events, config.stream_error_after, config.stream_error_status)
            spent = min(spent, count_tokens(sent_text(events)))  # a provider bills what it generated
        usage = responses_usage(sim.biller.charge(messages, spent, request.headers, config), outcome.reasoning_tokens)
        sim.stats.prompt_tokens += usage["input_tokens"]
        sim.stats.completion_tokens += spent
        response["usage"] = usage
        if body.get("store", True) and not (events and events[-1]["type"] == "response.failed"):
            self.store.put(response, items, prior)
        if stream:
            return await send_events(request, events, base_ms=config.latency_base_ms,
                                     per_token_ms=config.latency_per_token_ms, pause=sim._pause)
        await sim._pause(config.latency_base_ms + config.latency_per_token_ms * spent)
        return web.json_response(response)

    def _prior(self, previous_id: Any) -> list[dict[str, Any]]:
        if previous_id is None:
            return []
        context = self.store.context(previous_id) if isinstance(previous_id, str) else None
        if context is None:
            raise NotFound(f"Previous response with id '{previous_id}' not found.", param="previous_response_id",
                           code="previous_response_not_found")
        return context

    async def retrieve(self, request: web.Request) -> web.StreamResponse:
        """GET /responses/{id}: a stored response."""
        self._sim.stats.calls["responses_retrieve"] += 1
        self._served(request)
        return web.json_response(self._stored(request).response)

    async def delete(self, request: web.Request) -> web.StreamResponse:
        """DELETE /responses/{id}: forget a stored response."""
        self._sim.stats.calls["responses_delete"] += 1
        self._served(request)
        self._stored(request)
        self.store.delete(request.match_info["id"])
        return web.json_response({"id": request.match_info["id"], "object": "response.deleted", "deleted": True})

    async def input_items(self, request: web.Request) -> web.StreamResponse:
        """GET /responses/{id}/input_items: the items a stored response was answered from, as a list object
        (`order` desc by default, `limit` 1..100, default 20, `after` an item id)."""
        self._sim.stats.calls["responses_input_items"] += 1
        self._served(request)
        items = list(self._stored(request).input_items)
        query = request.query
        if query.get("order", "desc") == "desc":
            items.reverse()
        if "after" in query:
            ids = [item["id"] for item in items]
            items = items[ids.index(query["after"]) + 1:] if query["after"] in ids else []
        try:
            limit = int(query.get("limit", 20))
        except ValueError:
            raise InvalidRequest("Invalid 'limit': expected an integer.", param="limit") from None
        if not 1 <= limit <= 100:
            raise InvalidRequest("Invalid 'limit': expected an integer between 1 and 100.", param="limit")
        page = items[:limit]
        return web.json_response({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                                  "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})


def responses_routes(simulator: Simulator) -> tuple[ResponsesMode, list[web.RouteDef]]:
    """The Responses mode of `simulator` and its routes."""
    mode = ResponsesMode(simulator)
    return mode, mode.routes()
