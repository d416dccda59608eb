"""The simulated upstream: a real aiohttp server speaking the OpenAI endpoints the broker calls.

It serves `/v1/chat/completions` (plain and SSE), `/v1/responses` (`providers.simulator.responses`),
`/v1/embeddings` and `/v1/models` (also without the `/v1` prefix), plus `/stats` (with the bill),
`/_sim/bill`, `/_sim/last_request` and `/control/faults` for tests and benchmarks. What it answers (`answer_for`, merged calls block by block, token counts, embeddings) comes
from `providers.simulator.content`; faults (see `providers.simulator.faults`) are injected with a seeded
RNG and can be changed at run time, as can billing (`providers.simulator.billing`: usage with cached
tokens, a running bill) and streaming quirks (`providers.simulator.streaming`);
`providers.simulator.cli` is the `mergebroker simulate` command.
This module re-exports the names other code imports from it.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import structlog
from aiohttp import web

from mergebroker.clock import Clock, Sleep, monotonic
from mergebroker.errors import BrokerError, InvalidRequest
from mergebroker.providers.simulator.anthropic import anthropic_routes
from mergebroker.providers.simulator.azure import azure_routes
from mergebroker.providers.simulator.batches import add_batch_routes
from mergebroker.providers.simulator.billing import Biller
from mergebroker.providers.simulator.bodies import json_object
from mergebroker.providers.simulator.chat_agent import agent_reply
from mergebroker.providers.simulator.content import (
    answer_for,
    block_answers,
    compose_reply,
    count_tokens,
    embedding_vector,
    parse_request_blocks,
    prompt_tokens,
    question_text,
)
from mergebroker.providers.simulator.faults import (
    MAX_EMBEDDING_DIM,
    FaultInjector,
    SimulatorConfig,
    error_response,
    is_int,
)
from mergebroker.providers.simulator.injection import INJECTION_MARKER
from mergebroker.providers.simulator.responses import responses_routes
from mergebroker.providers.simulator.running import RunningSimulator
from mergebroker.providers.simulator.streaming import plan_stream, refuse_stream_fields, send_stream

log = structlog.get_logger(__name__)

__all__ = ["SimulatorConfig", "answer_for", "block_answers", "INJECTION_MARKER",
           "count_tokens", "prompt_tokens", "create_simulator_app", "start_simulator",
           "RunningSimulator", "Simulator", "SimulatorStats", "SIMULATOR_KEY"]


@dataclass
class SimulatorStats:
    """Counters since start or the last reset.

    `calls` counts every request per API endpoint; `chat_calls`, `embedding_calls` and `merged_calls`
    count well-formed calls, faulted or not; token counters count answered calls only
    (`prompt_tokens`/`completion_tokens` for chat, `embedding_tokens` for embeddings; of the prompt tokens,
    what the Anthropic mode's breakpoint cache read and wrote).
    """

    calls: Counter[str] = field(default_factory=Counter)
    chat_calls: int = 0
    stream_calls: int = 0
    embedding_calls: int = 0
    embedding_inputs: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    embedding_tokens: int = 0
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0
    merged_calls: int = 0
    faults_injected: int = 0
    faults: Counter[str] = field(default_factory=Counter)

    def record_faults(self, *names: str) -> None:
        """Count injected faults, each by name."""
        self.faults_injected += len(names)
        self.faults.update(names)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        data = asdict(self)
        data["calls"], data["faults"] = dict(self.calls), dict(self.faults)
        return data


def _chat_params(body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], int | None]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty array", param="messages")
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise InvalidRequest("every message needs a string 'role'", param="messages")
    limits = [body[k] for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None]
    if not all(is_int(v) and v > 0 for v in limits):
        raise InvalidRequest("'max_tokens' must be a positive integer", param="max_tokens")
    return messages, min(limits, default=None)


def _embedding_params(body: Mapping[str, Any]) -> tuple[list[str], int | None, str]:
    raw = body.get("input")
    items = [raw] if isinstance(raw, str) or (isinstance(raw, list) and raw and is_int(raw[0])) else raw
    if not isinstance(items, list) or not items:
        raise InvalidRequest("'input' must be a string or a non-empty array", param="input")
    texts = [" ".join(map(str, i)) if isinstance(i, list) and all(map(is_int, i)) else i for i in items]
    if not all(isinstance(t, str) for t in texts):
        raise InvalidRequest("'input' items must be strings or token arrays", param="input")
    dim = body.get("dimensions")
    if dim is not None and not (is_int(dim) and 1 <= dim <= MAX_EMBEDDING_DIM):
        raise InvalidRequest(f"'dimensions' must be an integer in [1, {MAX_EMBEDDING_DIM}]", param="dimensions")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise InvalidRequest("'encoding_format' must be 'float' or 'base64'", param="encoding_format")
    return texts, dim, encoding


async def _keep_cache(request: web.Request) -> bool:
    """A reset's `keep_cache` flag: false for an empty body, else a JSON object's boolean field."""
    if not await request.read():
        return False
    keep = (await json_object(request)).get("keep_cache", False)
    if not isinstance(keep, bool):
        raise InvalidRequest("'keep_cache' must be true or false", param="keep_cache")
    return keep


@web.middleware
async def _error_envelope(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every error leaves as an OpenAI error envelope, including the router's 404 and 405."""
    try:
        return await handler(request)
    except BrokerError as exc:
        return web.json_response(exc.body(), status=exc.status, headers=exc.headers())
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, exc.reason, "invalid_request_error", None)


class Simulator:
    """The simulated upstream's state (config, seeded RNG, counters, bill) and its request handlers.

    `sleep` is what simulated latency awaits; `clock` is what the prompt cache's TTL is measured on.
    """

    def __init__(self, config: SimulatorConfig, *, sleep: Sleep = asyncio.sleep, clock: Clock = monotonic) -> None:
        self._faults = FaultInjector(config)
        self._sleep = sleep
        self.stats = SimulatorStats()
        self.biller = Biller(clock)
        self.clock = clock  # what prompt caches measure their TTL on (the Anthropic mode's too)
        self.last_request_body: dict[str, Any] | None = None
        self.last_request: dict[str, Any] | None = None
        self.responses, self._responses_routes = responses_routes(self)

    @property
    def config(self) -> SimulatorConfig:
        """The current configuration (fault fields as changed at run time)."""
        return self._faults.config

    def record_request(self, request: web.Request, body: Any) -> None:
        """Keep the call's method, path, query, headers (names lower-cased) and body (GET /_sim/last_request shows
        them), so tests can check what a broker forwarded, headers and cache breakpoints included."""
        self.last_request_body = body
        self.last_request = {"method": request.method, "path": request.path, "query": request.query_string,
                             "headers": {k.lower(): v for k, v in request.headers.items()}, "body": body}

    def set_faults(self, **fields: Any) -> dict[str, Any]:
        """Change run-time fields now (faults, latency, billing, streaming); returns them all.
        Raises ValueError for bad fields."""
        return self._faults.update(**fields)

    def stats_dict(self) -> dict[str, Any]:
        """The counters and the bill, as GET /stats shows them."""
        return {**self.stats.as_dict(), "bill": self.biller.as_dict(self.config)}

    def reset_stats(self, *, keep_cache: bool = False) -> None:
        """Zero every counter and the bill; forget the prompt cache unless `keep_cache`."""
        self.stats = SimulatorStats()
        self.biller.reset(keep_cache=keep_cache)

    def close(self) -> None:
        """End hanging calls now, so that shutdown does not wait `hang_s` for them."""
        self._faults.close()

    def routes(self) -> list[web.RouteDef]:
        """The OpenAI routes, with and without the /v1 prefix, then those of the Anthropic and Azure modes."""
        table = [("POST", "/chat/completions", self.chat), ("POST", "/embeddings", self.embeddings),
                 ("GET", "/models", self.models), ("GET", "/stats", self.get_stats),
                 ("POST", "/stats/reset", self.post_stats_reset), ("GET", "/control/faults", self.get_faults),
                 ("POST", "/control/faults", self.post_faults), ("GET", "/_sim/bill", self.get_bill),
                 ("POST", "/_sim/bill/reset", self.post_bill_reset),
                 ("GET", "/_sim/last_request", self.get_last_request)]
        openai_routes = [web.route(method, prefix + path, handler)
                         for prefix in ("", "/v1") for method, path, handler in table]
        return openai_routes + self._responses_routes + anthropic_routes(self) + azure_routes(self)

    async def _injected_fault(self, request: web.Request, *, chat: bool, stream: bool = False,
                              random_faults: bool = True) -> web.StreamResponse | None:
        """Decide, count and carry out this call's fault: a response to send instead, or None to answer."""
        fault = self._faults.take(chat=chat, random_faults=random_faults)
        if fault is not None:
            self.stats.record_faults(fault.value)
        return await self._faults.act(fault, request, stream=stream)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """POST /chat/completions: answer, answer every block of a merged call, answer as an agent's model (tool
        calls, tool results, structured output: `providers.simulator.chat_agent`), or inject a fault.

        The reply stops at `max_tokens` / `max_completion_tokens` (finish_reason "length"), as providers do.
        """
        self.stats.calls["chat_completions"] += 1
        body = await json_object(request)
        self.record_request(request, body)
        messages, max_tokens = _chat_params(body)
        config = self.config
        refuse_stream_fields(body, config)
        asked_stream = bool(body.get("stream"))
        self.stats.chat_calls += 1
        self.stats.stream_calls += int(asked_stream)
        self.stats.merged_calls += int(bool(parse_request_blocks(question_text(messages))))
        stream = asked_stream and not config.ignore_stream
        if (early := await self._injected_fault(request, chat=True, stream=stream)) is not None:
            return early
        reply = (agent_reply(body, messages, max_tokens=max_tokens, words=config.answer_words)
                 or compose_reply(messages, max_tokens=max_tokens, config=config, rng=self._faults.rng))
        self.stats.record_faults(*reply.faults)
        plan = plan_stream(reply, config, self._faults.rng) if stream else None
        completion_tokens = reply.completion_tokens
        if plan is not None and plan.error_after is not None:
            self.stats.record_faults("stream_error")
            completion_tokens = count_tokens(plan.sent_text)  # a provider bills what it generated
        usage = self.biller.charge(messages, completion_tokens, request.headers, config)
        self.stats.prompt_tokens += usage["prompt_tokens"]
        self.stats.completion_tokens += usage["completion_tokens"]
        meta = {"id": f"chatcmpl-sim-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
                "model": body.get("model") or config.models[0]}
        if plan is not None:
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return await send_stream(request, meta, plan, usage=usage if include_usage else None, config=config,
                                     pause=self._pause)
        await self._pause(config.latency_base_ms + config.latency_per_token_ms * reply.completion_tokens)
        message = {"role": "assistant", "content": reply.content or (None if reply.tool_calls else ""),
                   "refusal": None, **({"tool_calls": list(reply.tool_calls)} if reply.tool_calls else {})}
        return web.json_response({**meta, "object": "chat.completion", "system_fingerprint": "sim", "usage": usage,
                                  "choices": [{"index": 0, "message": message, "logprobs": None,
                                               "finish_reason": reply.finish_reason}]})

    async def _pause(self, milliseconds: float) -> None:
        if milliseconds > 0:
            await self._sleep(milliseconds / 1000)

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        """POST /embeddings: deterministic unit vectors per input, as float lists or base64 float32."""
        self.stats.calls["embeddings"] += 1
        body = await json_object(request)
        self.record_request(request, body)
        texts, dim, encoding = _embedding_params(body)
        self.stats.embedding_calls += 1
        self.stats.embedding_inputs += len(texts)
        if (early := await self._injected_fault(request, chat=False)) is not None:
            return early
        tokens = sum(count_tokens(t) for t in texts)
        self.stats.embedding_tokens += tokens
        await self._pause(self.config.latency_base_ms)
        vectors = [embedding_vector(t, dim or self.config.embedding_dim) for t in texts]
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v.tobytes()).decode() if encoding == "base64" else v.tolist()}
                for i, v in enumerate(vectors)]
        return web.json_response({"object": "list", "data": data, "model": body.get("model") or self.config.models[-1],
                                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def models(self, request: web.Request) -> web.StreamResponse:
        """GET /models: the configured model names (only `down` and `status_override` apply here)."""
        self.stats.calls["models"] += 1
        if (early := await self._injected_fault(request, chat=False, random_faults=False)) is not None:
            return early
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "simulator"} for m in self.config.models]
        return web.json_response({"object": "list", "data": data})

    async def get_stats(self, request: web.Request) -> web.StreamResponse:
        """GET /stats: the counters, and the bill under "bill"."""
        return web.json_response(self.stats_dict())

    async def post_stats_reset(self, request: web.Request) -> web.StreamResponse:
        """POST /stats/reset: zero the counters and the bill; `{"keep_cache": true}` keeps the prompt cache warm."""
        self.reset_stats(keep_cache=await _keep_cache(request))
        return web.json_response(self.stats_dict())

    async def get_bill(self, request: web.Request) -> web.StreamResponse:
        """GET /_sim/bill: requests, prompt, cached and completion tokens, dollars, mode and prices."""
        return web.json_response(self.biller.as_dict(self.config))

    async def post_bill_reset(self, request: web.Request) -> web.StreamResponse:
        """POST /_sim/bill/reset: zero the bill and forget the prompt cache (unless `{"keep_cache": true}`),
        leaving the other counters alone, so that two benchmark arms can run against one simulator."""
        self.biller.reset(keep_cache=await _keep_cache(request))
        return web.json_response(self.biller.as_dict(self.config))

    async def get_last_request(self, request: web.Request) -> web.StreamResponse:
        """GET /_sim/last_request: the last API call's method, path, query, headers and body (null before any)."""
        return web.json_response(self.last_request)

    async def get_faults(self, request: web.Request) -> web.StreamResponse:
        """GET /control/faults: the fields that change at run time (faults, latency, billing, streaming)."""
        return web.json_response(self.config.runtime_fields())

    async def post_faults(self, request: web.Request) -> web.StreamResponse:
        """POST /control/faults: change the fields given in the JSON body; answers with all of them."""
        body = await json_object(request)
        try:
            return web.json_response(self.set_faults(**body))
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc


SIMULATOR_KEY = web.AppKey("simulator", Simulator)


def create_simulator_app(config: SimulatorConfig, *, sleep: Sleep = asyncio.sleep,
                         clock: Clock = monotonic) -> web.Application:
    """The simulator as an aiohttp application; `app[SIMULATOR_KEY]` is its `Simulator`.

    `sleep` is what simulated latency awaits (inject a recorder in tests); `clock` is what the prompt
    cache's TTL runs on (inject a `FakeClock` in tests).
    """
    simulator = Simulator(config, sleep=sleep, clock=clock)
    app = web.Application(middlewares=[_error_envelope])
    app[SIMULATOR_KEY] = simulator
    app.add_routes(simulator.routes())
    add_batch_routes(app)  # /files and /batches (providers.simulator.batches)

    async def end_hangs(_: web.Application) -> None:
        simulator.close()

    app.on_shutdown.append(end_hangs)
    return app


async def start_simulator(config: SimulatorConfig | None = None, host: str = "127.0.0.1", port: int = 0,
                          *, sleep: Sleep = asyncio.sleep, clock: Clock = monotonic) -> RunningSimulator:
    """Start a simulator on host:port (port 0 picks a free one) and return it running."""
    app = create_simulator_app(config or SimulatorConfig(), sleep=sleep, clock=clock)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound_port = runner.addresses[0][1]
    log.info("simulator_started", host=host, port=bound_port)
    return RunningSimulator(runner, app[SIMULATOR_KEY], host, bound_port)
