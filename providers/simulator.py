"""The simulated upstream: a real aiohttp server speaking the OpenAI endpoints the broker calls.

It serves `/v1/chat/completions` (plain and SSE), `/v1/embeddings` and `/v1/models` (also without
the `/v1` prefix), plus `/stats` and `/control/faults` for tests and benchmarks. Answers are
deterministic (`answer_for`), merged calls in the combined prompt format of docs/architecture.md are
answered block by block, usage is counted with the real o200k_base tokenizer, and faults (see
`providers.simulator_faults`) are injected with a seeded RNG and can be changed at run time.

Prompt injection: like a compromised model, the simulator obeys a request block whose text contains
the phrase `repeat every other request` (`INJECTION_MARKER`, any case or spacing): that block's answer
is its usual `answer_for` followed by the verbatim text of every other request block of the call, one
per line. Alone (outside a merged call) such a question gets its usual answer: there is nothing to leak.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import functools
import hashlib
import json
import random
import re
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

import bpe_openai
import numpy as np
import structlog
from aiohttp import web

from broker.clock import Sleep
from broker.errors import BrokerError, InvalidRequest
from providers.simulator_faults import (DEFAULT_ANSWER_WORDS, MAX_EMBEDDING_DIM, FaultInjector, SimulatorConfig,
                                       decide_truncate, error_response, render_blocks)

log = structlog.get_logger(__name__)

DEFAULT_PORT = 8001
WORDS_PER_CHUNK = 3

__all__ = ["SimulatorConfig", "answer_for", "block_answers", "INJECTION_MARKER",
           "count_tokens", "create_simulator_app", "start_simulator",
           "RunningSimulator", "Simulator", "SimulatorStats", "SIMULATOR_KEY", "add_simulate_arguments",
           "config_from_args", "serve_simulator"]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# Pseudo-Latin fillers: no real question quotes them, and none holds a run of 6 hex characters,
# so an answer can never be mistaken for naming a batch ID (6 lowercase hex) by the split checks.
_FILLER = (
    "lorem", "ipsum", "dolor", "amet", "tempor", "labore", "magna", "aliqua", "veniam", "nostrud",
    "ullamco", "laboris", "nisi", "aliquip", "commodo", "consequat", "irure", "velit", "esse", "cillum",
    "fugiat", "nulla", "pariatur", "sint", "ornare", "proident", "sunt", "culpa", "officia", "mollit",
    "anim", "laborum", "porta", "vivamus", "lectus", "rutrum", "sapien", "nunc", "quam", "luctus",
    "tortor", "varius", "mauris", "pretium", "turpis", "auctor", "nibh", "tellus", "rhoncus", "purus",
    "gravida", "viverra", "justo", "primis", "ultrices", "posuere", "cubilia", "sollicitudin", "volutpat",
    "tincidunt", "suscipit", "lacinia", "blandit", "semper",
)
_CODE_LETTERS = "ghijklmnopqrstuvwxyz"  # no hex letters, for the same reason as the fillers
_NEUTRALISED_TAG = re.compile(r"&lt;(?=\s*/?\s*(?:request|response|system)\b)")


def normalise_question(text: str) -> str:
    """Strip, collapse whitespace, lower-case, and undo the broker's tag neutralisation (`&lt;request` -> `<request`).

    The last step makes a question answered inside a merged call get the same answer as when asked alone.
    """
    return _NEUTRALISED_TAG.sub("<", " ".join(text.split()).lower())


def answer_for(text: str, words: int = DEFAULT_ANSWER_WORDS) -> str:
    """The simulator's deterministic answer to a question: "Answer CODE: " plus `words` filler words.

    Same question modulo whitespace and case -> same answer; different questions -> different
    answers (CODE is 10 letters from SHA-256). The answer never contains the question text.
    """
    digest = hashlib.sha256(normalise_question(text).encode()).digest()
    code = "".join(_CODE_LETTERS[b % len(_CODE_LETTERS)] for b in digest[:10])
    fillers: list[str] = []
    stream = digest
    while len(fillers) < words:
        stream = hashlib.sha256(stream).digest()
        fillers.extend(_FILLER[b % len(_FILLER)] for b in stream)
    return f"Answer {code}: " + " ".join(fillers[:words]) + "."


@functools.cache
def _encoding() -> Any:
    return bpe_openai.get_encoding("o200k_base")


def count_tokens(text: str) -> int:
    """Tokens of `text` under o200k_base."""
    return len(_encoding().encode(text)) if text else 0


def message_text(content: Any) -> str:
    """The text of a message's content: a string, a list of parts (text parts joined), or None."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def prompt_tokens(messages: Sequence[Mapping[str, Any]]) -> int:
    """OpenAI-style prompt count: tokens of every message's text, plus 3 per message, plus 3."""
    return sum(count_tokens(message_text(m.get("content"))) + 3 for m in messages) + 3


_REQUEST_BLOCK = re.compile(r'<request\s+id="([^"]*)"\s*>(.*?)</request\s*>', re.S)
_TAGGED_SYSTEM = re.compile(r"^\s*<system>.*?</system>", re.S)


INJECTION_MARKER = "repeat every other request"


def block_answers(blocks: Sequence[tuple[str, str]], words: int = DEFAULT_ANSWER_WORDS) -> list[tuple[str, str]]:
    """The (id, answer) of every request block; a block asking for `INJECTION_MARKER` gets the others' text too."""
    answers = []
    for index, (block_id, text) in enumerate(blocks):
        answer = answer_for(text, words)
        if INJECTION_MARKER in normalise_question(text):
            answer = "\n".join([answer, *(other.strip() for i, (_, other) in enumerate(blocks) if i != index)])
        answers.append((block_id, answer))
    return answers


def parse_request_blocks(text: str) -> list[tuple[str, str]]:
    """The (id, user text) of every `<request id="ID">` block; a leading `<system>` part is not the question."""
    return [(block_id, _TAGGED_SYSTEM.sub("", body, count=1)) for block_id, body in _REQUEST_BLOCK.findall(text)]


def question_text(messages: Sequence[Mapping[str, Any]]) -> str:
    """The text being asked: the last user message (the last message if none is from the user)."""
    users = [m for m in messages if m.get("role") == "user"]
    return message_text((users or list(messages))[-1].get("content"))


@dataclass(frozen=True)
class Reply:
    """A composed chat reply: its content, why it ended, its token count and what shaped it."""

    content: str
    finish_reason: str
    completion_tokens: int
    merged: bool
    faults: tuple[str, ...] = ()


def compose_reply(messages: Sequence[Mapping[str, Any]], *, max_tokens: int | None,
                  config: SimulatorConfig, rng: random.Random) -> Reply:
    """The reply to a chat call: one answer, or one block per request block (with block faults);
    then the truncate fault (cut in half) and `max_tokens` (cut at that many tokens), both "length"."""
    blocks = parse_request_blocks(question_text(messages))
    faults: list[str] = []
    if blocks:
        content, faults = render_blocks(block_answers(blocks, config.answer_words), config, rng)
    else:
        content = answer_for(question_text(messages), config.answer_words)
    finish_reason = "stop"
    if decide_truncate(config, rng):
        content, finish_reason = content[: len(content) // 2], "length"
        faults.append("truncate")
    tokens = _encoding().encode(content) if content else []
    if max_tokens is not None and len(tokens) > max_tokens:
        content, finish_reason, tokens = _encoding().decode(tokens[:max_tokens]), "length", tokens[:max_tokens]
    return Reply(content, finish_reason, len(tokens), bool(blocks), tuple(faults))


def stream_pieces(content: str, words: int = WORDS_PER_CHUNK) -> list[str]:
    """Content split into pieces of a few words each; joined they give back `content` exactly."""
    parts = re.findall(r"\s*\S+|\s+$", content)
    return ["".join(parts[i:i + words]) for i in range(0, len(parts), words)]


@functools.lru_cache(maxsize=16384)
def _hashed_unit(key: str, dim: int) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    vector = np.random.default_rng(seed).standard_normal(dim)
    vector /= np.linalg.norm(vector)
    vector.flags.writeable = False
    return vector


def embedding_vector(text: str, dim: int) -> np.ndarray:
    """A deterministic unit-norm float32 vector for `text`.

    Mostly the sum of per-word hashed vectors (so texts sharing words have a high cosine, which
    lets the broker's similarity grouping work against the simulator), plus a small hashed part
    of the exact text so that different texts never share a vector.
    """
    words = re.findall(r"\w+", text.lower())
    vector = 0.1 * _hashed_unit("text\0" + text, dim)
    if words:
        bag = np.sum([_hashed_unit("word\0" + w, dim) for w in words], axis=0)
        vector = vector + 0.9 * bag / max(float(np.linalg.norm(bag)), 1e-12)
    return (vector / np.linalg.norm(vector)).astype("<f4")


@dataclass
class SimulatorStats:
    """Counters since start or the last reset.

    `calls` counts every request per API endpoint; `chat_calls`, `embedding_calls` and `merged_calls`
    count well-formed calls, faulted or not; token counters count answered calls only
    (`prompt_tokens`/`completion_tokens` for chat, `embedding_tokens` for embeddings).
    """

    calls: Counter[str] = field(default_factory=Counter)
    chat_calls: int = 0
    stream_calls: int = 0
    embedding_calls: int = 0
    embedding_inputs: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    embedding_tokens: int = 0
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


async def _json_object(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest("request body is not valid JSON") from exc
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return body


def _chat_params(body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], int | None]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty array", param="messages")
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise InvalidRequest("every message needs a string 'role'", param="messages")
    limits = [body[k] for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None]
    if not all(_is_int(v) and v > 0 for v in limits):
        raise InvalidRequest("'max_tokens' must be a positive integer", param="max_tokens")
    return messages, min(limits, default=None)


def _embedding_params(body: Mapping[str, Any]) -> tuple[list[str], int | None, str]:
    raw = body.get("input")
    items = [raw] if isinstance(raw, str) or (isinstance(raw, list) and raw and _is_int(raw[0])) else raw
    if not isinstance(items, list) or not items:
        raise InvalidRequest("'input' must be a string or a non-empty array", param="input")
    texts = [" ".join(map(str, i)) if isinstance(i, list) and all(map(_is_int, i)) else i for i in items]
    if not all(isinstance(t, str) for t in texts):
        raise InvalidRequest("'input' items must be strings or token arrays", param="input")
    dim = body.get("dimensions")
    if dim is not None and not (_is_int(dim) and 1 <= dim <= MAX_EMBEDDING_DIM):
        raise InvalidRequest(f"'dimensions' must be an integer in [1, {MAX_EMBEDDING_DIM}]", param="dimensions")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise InvalidRequest("'encoding_format' must be 'float' or 'base64'", param="encoding_format")
    return texts, dim, encoding


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
    """The simulated upstream's state (config, seeded RNG, counters) and its request handlers."""

    def __init__(self, config: SimulatorConfig, *, sleep: Sleep = asyncio.sleep) -> None:
        self._faults = FaultInjector(config)
        self._sleep = sleep
        self.stats = SimulatorStats()
        self.last_request_body: dict[str, Any] | None = None

    @property
    def config(self) -> SimulatorConfig:
        """The current configuration (fault fields as changed at run time)."""
        return self._faults.config

    def set_faults(self, **fields: Any) -> dict[str, Any]:
        """Change fault/latency fields now; returns them all. Raises ValueError for bad fields."""
        return self._faults.update(**fields)

    def reset_stats(self) -> None:
        """Zero every counter."""
        self.stats = SimulatorStats()

    def close(self) -> None:
        """End hanging calls now, so that shutdown does not wait `hang_s` for them."""
        self._faults.close()

    def routes(self) -> list[web.RouteDef]:
        """The routes, each served with and without the /v1 prefix."""
        table = [("POST", "/chat/completions", self.chat), ("POST", "/embeddings", self.embeddings),
                 ("GET", "/models", self.models), ("GET", "/stats", self.get_stats),
                 ("POST", "/stats/reset", self.post_stats_reset), ("GET", "/control/faults", self.get_faults),
                 ("POST", "/control/faults", self.post_faults)]
        return [web.route(method, prefix + path, handler)
                for prefix in ("", "/v1") for method, path, handler in table]

    async def _injected_fault(self, request: web.Request, *, chat: bool, stream: bool = False,
                              random_faults: bool = True) -> web.StreamResponse | None:
        """Decide, count and carry out this call's fault: a response to send instead, or None to answer."""
        fault = self._faults.take(chat=chat, random_faults=random_faults)
        if fault is not None:
            self.stats.record_faults(fault.value)
        return await self._faults.act(fault, request, stream=stream)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """POST /chat/completions: answer, answer every block of a merged call, or inject a fault."""
        self.stats.calls["chat_completions"] += 1
        body = self.last_request_body = await _json_object(request)
        messages, max_tokens = _chat_params(body)
        stream = bool(body.get("stream"))
        self.stats.chat_calls += 1
        self.stats.stream_calls += int(stream)
        self.stats.merged_calls += int(bool(parse_request_blocks(question_text(messages))))
        if (early := await self._injected_fault(request, chat=True, stream=stream)) is not None:
            return early
        config = self.config
        reply = compose_reply(messages, max_tokens=max_tokens, config=config, rng=self._faults.rng)
        self.stats.record_faults(*reply.faults)
        usage = {"prompt_tokens": prompt_tokens(messages), "completion_tokens": reply.completion_tokens}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        self.stats.prompt_tokens += usage["prompt_tokens"]
        self.stats.completion_tokens += reply.completion_tokens
        meta = {"id": f"chatcmpl-sim-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
                "model": body.get("model") or config.models[0]}
        if stream:
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return await self._stream(request, meta, reply, usage if include_usage else None)
        await self._pause(config.latency_base_ms + config.latency_per_token_ms * reply.completion_tokens)
        message = {"role": "assistant", "content": reply.content, "refusal": None}
        return web.json_response({**meta, "object": "chat.completion", "system_fingerprint": "sim", "usage": usage,
                                  "choices": [{"index": 0, "message": message, "logprobs": None,
                                               "finish_reason": reply.finish_reason}]})

    async def _pause(self, milliseconds: float) -> None:
        if milliseconds > 0:
            await self._sleep(milliseconds / 1000)

    async def _stream(self, request: web.Request, meta: dict[str, Any], reply: Reply,
                      usage: dict[str, int] | None) -> web.StreamResponse:
        """SSE: a role chunk, content chunks of a few words, a finish chunk, the usage chunk if asked, [DONE].

        The base latency comes before the first chunk; the per-token latency is spread over the
        content chunks in proportion to their length.
        """
        def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            chunk = {**meta, "object": "chat.completion.chunk", "system_fingerprint": "sim", "choices": choices,
                     **({"usage": None} if usage is not None else {}), **extra}
            return f"data: {json.dumps(chunk)}\n\n".encode()

        def choice(delta: dict[str, Any], finish_reason: str | None = None) -> list[dict[str, Any]]:
            return [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]

        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        await self._pause(self.config.latency_base_ms)
        await response.write(event(choice({"role": "assistant", "content": ""})))
        per_token_ms = self.config.latency_per_token_ms * reply.completion_tokens
        for piece in stream_pieces(reply.content):
            await self._pause(per_token_ms * len(piece) / len(reply.content))
            await response.write(event(choice({"content": piece})))
        await response.write(event(choice({}, reply.finish_reason)))
        if usage is not None:
            await response.write(event([], usage=usage))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        """POST /embeddings: deterministic unit vectors per input, as float lists or base64 float32."""
        self.stats.calls["embeddings"] += 1
        body = self.last_request_body = await _json_object(request)
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
        """GET /stats: the counters."""
        return web.json_response(self.stats.as_dict())

    async def post_stats_reset(self, request: web.Request) -> web.StreamResponse:
        """POST /stats/reset: zero the counters."""
        self.reset_stats()
        return web.json_response(self.stats.as_dict())

    async def get_faults(self, request: web.Request) -> web.StreamResponse:
        """GET /control/faults: the fault and latency fields."""
        return web.json_response(self.config.runtime_fields())

    async def post_faults(self, request: web.Request) -> web.StreamResponse:
        """POST /control/faults: change the fields given in the JSON body; answers with all of them."""
        body = await _json_object(request)
        try:
            return web.json_response(self.set_faults(**body))
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc


SIMULATOR_KEY = web.AppKey("simulator", Simulator)


def create_simulator_app(config: SimulatorConfig, *, sleep: Sleep = asyncio.sleep) -> web.Application:
    """The simulator as an aiohttp application; `app[SIMULATOR_KEY]` is its `Simulator`.

    `sleep` is what simulated latency awaits (inject a recorder in tests).
    """
    simulator = Simulator(config, sleep=sleep)
    app = web.Application(middlewares=[_error_envelope])
    app[SIMULATOR_KEY] = simulator
    app.add_routes(simulator.routes())

    async def end_hangs(_: web.Application) -> None:
        simulator.close()

    app.on_shutdown.append(end_hangs)
    return app


class RunningSimulator:
    """A simulator serving on a loopback port; direct access to its counters and faults (no HTTP)."""

    def __init__(self, runner: web.AppRunner, simulator: Simulator, host: str, port: int) -> None:
        self._runner = runner
        self._simulator = simulator
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        """The OpenAI base URL, e.g. "http://127.0.0.1:PORT/v1"."""
        return f"http://{self.host}:{self.port}/v1"

    @property
    def config(self) -> SimulatorConfig:
        """The current configuration."""
        return self._simulator.config

    def stats(self) -> dict[str, Any]:
        """The counters, as GET /stats shows them."""
        return self._simulator.stats.as_dict()

    def set_faults(self, **fields: Any) -> dict[str, Any]:
        """Change fault/latency fields now (ValueError for bad ones); returns them all."""
        return self._simulator.set_faults(**fields)

    def last_request_body(self) -> dict[str, Any] | None:
        """The JSON body of the last chat or embeddings call received (to check what a broker forwarded)."""
        return self._simulator.last_request_body

    def reset_stats(self) -> None:
        """Zero every counter."""
        self._simulator.reset_stats()

    async def close(self) -> None:
        """Stop serving; hanging calls end at once."""
        self._simulator.close()
        await self._runner.cleanup()

    async def __aenter__(self) -> RunningSimulator:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


async def start_simulator(config: SimulatorConfig | None = None, host: str = "127.0.0.1", port: int = 0,
                          *, sleep: Sleep = asyncio.sleep) -> RunningSimulator:
    """Start a simulator on host:port (port 0 picks a free one) and return it running."""
    app = create_simulator_app(config or SimulatorConfig(), sleep=sleep)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound_port = runner.addresses[0][1]
    log.info("simulator_started", host=host, port=bound_port)
    return RunningSimulator(runner, app[SIMULATOR_KEY], host, bound_port)


_CLI_OPTIONS: tuple[tuple[str, Any, str], ...] = (
    ("answer_words", int, "filler words per answer"),
    ("seed", int, "seed of the fault RNG (same seed, same fault sequence)"),
    ("embedding_dim", int, "embedding dimension when a request gives no 'dimensions'"),
    ("latency_base_ms", float, "latency of every call, in ms"),
    ("latency_per_token_ms", float, "extra latency per completion token, in ms"),
    ("error_rate", float, "probability of a 500 per call"),
    ("rate_429", float, "probability of a 429 with Retry-After per call"),
    ("retry_after_s", float, "Retry-After seconds sent with 429s"),
    ("timeout_rate", float, "probability that a call hangs for --hang-s before answering"),
    ("hang_s", float, "how long a hanging call waits"),
    ("truncate_rate", float, "probability that a chat reply is cut in half (finish_reason length)"),
    ("malformed_rate", float, "probability of a 200 whose body is not valid JSON"),
    ("drop_block_rate", float, "merged calls: probability that one response block is omitted"),
    ("duplicate_block_rate", float, "merged calls: probability that one response block is repeated"),
    ("garble_block_rate", float, "merged calls: probability that one block's tags are broken"),
    ("reorder_blocks", bool, "merged calls: answer the blocks in reverse order"),
    ("chatter", bool, "merged calls: add chatter before and after the blocks"),
    ("down", bool, "answer every call with 503"),
    ("status_override", int, "answer every call with this HTTP status"),
    ("fail_first_n", int, "fail the first N chat calls with 503"),
)


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    """The `mergebroker simulate` options: where to listen, models, latency and faults."""
    defaults = SimulatorConfig()
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on, 0 for any (default: %(default)s)")
    parser.add_argument("--models", default=",".join(defaults.models),
                        help="comma-separated model names for /v1/models (default: %(default)s)")
    for name, kind, help_text in _CLI_OPTIONS:
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, action="store_true", help=help_text)
        else:
            parser.add_argument(flag, type=kind, default=getattr(defaults, name),
                                help=help_text + " (default: %(default)s)")


def config_from_args(ns: argparse.Namespace) -> SimulatorConfig:
    """The SimulatorConfig of parsed `simulate` options; options missing from `ns` keep their defaults."""
    defaults = SimulatorConfig()
    models = tuple(m.strip() for m in str(getattr(ns, "models", "") or "").split(",") if m.strip())
    values = {name: getattr(ns, name, getattr(defaults, name)) for name, _, _ in _CLI_OPTIONS}
    return SimulatorConfig(models=models or defaults.models, **values)


async def serve_simulator(ns: argparse.Namespace) -> None:
    """Serve the simulator from parsed `simulate` options until cancelled."""
    simulator = await start_simulator(config_from_args(ns), host=getattr(ns, "host", "127.0.0.1"),
                                      port=getattr(ns, "port", DEFAULT_PORT))
    log.info("simulator_serving", url=simulator.url)
    try:
        await asyncio.Event().wait()
    finally:
        await simulator.close()
