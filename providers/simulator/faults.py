"""Configuration and fault injection of the simulated upstream.

`SimulatorConfig` is everything the simulator is told to do. Two kinds of faults exist. Call
faults replace the whole answer (an error status, a hang, a body that is not JSON); the pure
`decide_call_fault` picks one per call and `FaultInjector` acts on it. Block faults damage the
reply of a merged call (a block dropped, repeated, garbled, the order reversed, chatter around
the blocks); the pure `render_blocks` applies them while it writes the reply.

Randomness is drawn only for rates above zero, so a rate of 0 never fires, a rate of 1 always
fires, and enabling one fault does not shift the sequence another one sees when it is off.

The config also holds what is not a fault but changes at run time the same way: how the simulator
bills (`providers.simulator.billing`) and how it streams (`providers.simulator.streaming`).
"""

from __future__ import annotations

import asyncio
import enum
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import structlog
from aiohttp import web

from mergebroker.errors import error_body

log = structlog.get_logger(__name__)

DEFAULT_ANSWER_WORDS = 12
MAX_EMBEDDING_DIM = 8192
BILLING_MODES = ("none", "openai")
CACHE_SCOPES = ("key", "global")
STREAM_ERROR_STATUSES = (429, 529)
RATE_FIELDS = ("error_rate", "rate_429", "timeout_rate", "truncate_rate", "malformed_rate",
               "drop_block_rate", "duplicate_block_rate", "garble_block_rate", "merge_degrade", "stream_error_rate",
               "split_failure_rate")
_NON_NEGATIVE_FIELDS = ("latency_base_ms", "latency_per_token_ms", "retry_after_s", "hang_s",
                        "price_input", "price_cached_input", "price_output")
_BOOL_FIELDS = ("reorder_blocks", "chatter", "down", "quiz", "ignore_stream", "reject_stream_options",
                "reject_stream", "responses")
_CHOICE_FIELDS: dict[str, tuple[Any, ...]] = {"billing": BILLING_MODES, "cache_scope": CACHE_SCOPES,
                                              "stream_error_status": STREAM_ERROR_STATUSES}
RUNTIME_FIELDS = (*RATE_FIELDS, "latency_base_ms", "latency_per_token_ms", "retry_after_s", "hang_s",
                  "reorder_blocks", "chatter", "down", "status_override", "fail_first_n", "quiz", "answer_words",
                  "billing", "cache_scope", "cache_ttl_s", "price_input", "price_cached_input", "price_output",
                  "ignore_stream", "reject_stream_options", "reject_stream", "stream_error_after",
                  "stream_error_status", "responses", "token_scale")
CHATTER_BEFORE = "Sure! Here are the answers:"
CHATTER_AFTER = "Let me know if you need anything else."
MALFORMED_BODY = '{"id": "chatcmpl-sim-broken", "object": "chat.completion", "choices": [{"index"'


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_int(value: Any) -> bool:
    """Whether `value` is an int proper (JSON true/false arrive as bool, a subclass of int, and are not)."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SimulatorConfig:
    """Everything the simulator does: models, answers, latency, faults (all rates are 0..1 per call),
    billing and streaming.

    Every field but models, seed and embedding_dim (`RUNTIME_FIELDS`) can be changed while it runs;
    `fail_first_n` then counts down as chat calls fail. Invalid values raise ValueError.
    """

    models: tuple[str, ...] = ("sim-small", "sim-large", "sim-embed")
    answer_words: int = DEFAULT_ANSWER_WORDS
    seed: int = 0
    embedding_dim: int = 384
    latency_base_ms: float = 0.0
    latency_per_token_ms: float = 0.0
    error_rate: float = 0.0
    rate_429: float = 0.0
    retry_after_s: float = 1.0
    timeout_rate: float = 0.0
    hang_s: float = 30.0
    truncate_rate: float = 0.0
    malformed_rate: float = 0.0
    drop_block_rate: float = 0.0
    duplicate_block_rate: float = 0.0
    garble_block_rate: float = 0.0
    # Merged calls: probability that the model ignores the tagged format and answers in plain prose, as a
    # small model that cannot follow it does (every member's split fails).
    split_failure_rate: float = 0.0
    reorder_blocks: bool = False
    chatter: bool = False
    down: bool = False
    status_override: int | None = None
    fail_first_n: int = 0
    quiz: bool = False  # answer the built-in question set correctly (providers.simulator.quiz_mode)
    merge_degrade: float = 0.0  # merged calls: wrong answers grow with batch size (providers.simulator.quiz_mode)
    # Billing (providers.simulator.billing): "openai" keeps an automatic prompt cache and reports cached tokens.
    billing: str = "none"
    cache_scope: str = "key"  # "key": one cache per API key; "global": one for everyone
    cache_ttl_s: float = 300.0
    price_input: float = 2.50  # USD per million tokens, gpt-4o's list prices
    price_cached_input: float = 1.25
    price_output: float = 10.0
    # How this provider's tokenizer counts against o200k_base (1.3: 30% more tokens), in every usage it
    # reports and bills: real providers (Anthropic, Gemini, open models) count with tokenizers of their own.
    token_scale: float = 1.0
    # Streaming quirks and errors mid-stream (providers.simulator.streaming).
    ignore_stream: bool = False
    reject_stream_options: bool = False
    reject_stream: bool = False
    stream_error_rate: float = 0.0
    stream_error_after: int = 3
    stream_error_status: int = 429
    # False: a chat-only upstream, /v1/responses answers 404 (providers.simulator.responses).
    responses: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", tuple(self.models))
        problems = [f"{n} must be a number in [0, 1]" for n in RATE_FIELDS
                    if not (_is_number(getattr(self, n)) and 0 <= getattr(self, n) <= 1)]
        problems += [f"{n} must be a number >= 0" for n in _NON_NEGATIVE_FIELDS
                     if not (_is_number(getattr(self, n)) and getattr(self, n) >= 0)]
        problems += [f"{n} must be true or false" for n in _BOOL_FIELDS if not isinstance(getattr(self, n), bool)]
        problems += [f"{n} must be one of {', '.join(map(str, choices))}" for n, choices in _CHOICE_FIELDS.items()
                     if isinstance(getattr(self, n), bool) or getattr(self, n) not in choices]
        if not (_is_number(self.token_scale) and 0.25 <= self.token_scale <= 4):
            problems.append("token_scale must be a number in [0.25, 4]")
        if not (_is_number(self.cache_ttl_s) and self.cache_ttl_s > 0):
            problems.append("cache_ttl_s must be a number > 0")
        if not (is_int(self.stream_error_after) and self.stream_error_after >= 0):
            problems.append("stream_error_after must be an integer >= 0")
        if not (is_int(self.fail_first_n) and self.fail_first_n >= 0):
            problems.append("fail_first_n must be an integer >= 0")
        if not (self.status_override is None or (is_int(self.status_override) and 400 <= self.status_override <= 599)):
            problems.append("status_override must be null or an HTTP error status (400..599)")
        if not (is_int(self.answer_words) and self.answer_words >= 1):
            problems.append("answer_words must be an integer >= 1")
        if not (is_int(self.embedding_dim) and 1 <= self.embedding_dim <= MAX_EMBEDDING_DIM):
            problems.append(f"embedding_dim must be an integer in [1, {MAX_EMBEDDING_DIM}]")
        if not is_int(self.seed):
            problems.append("seed must be an integer")
        if not self.models or not all(isinstance(m, str) and m for m in self.models):
            problems.append("models must be non-empty names")
        if problems:
            raise ValueError("; ".join(problems))

    def runtime_fields(self) -> dict[str, Any]:
        """The fields that change at run time, as /control/faults shows them."""
        return {name: getattr(self, name) for name in RUNTIME_FIELDS}

    def with_runtime_fields(self, **fields: Any) -> SimulatorConfig:
        """A copy with run-time fields changed; other or unknown fields raise ValueError."""
        unknown = sorted(set(fields) - set(RUNTIME_FIELDS))
        if unknown:
            raise ValueError(f"not a field that changes at run time: {', '.join(unknown)}")
        return replace(self, **fields)


class CallFault(enum.Enum):
    """A fault that decides the whole outcome of one call; `value` names it in stats."""

    DOWN = "down"
    STATUS_OVERRIDE = "status_override"
    FAIL_FIRST = "fail_first"
    ERROR = "error"
    RATE_429 = "rate_429"
    TIMEOUT = "timeout"
    MALFORMED = "malformed"


def _fires(rate: float, rng: random.Random) -> bool:
    return rate > 0 and rng.random() < rate


def decide_call_fault(faults: SimulatorConfig, rng: random.Random, *, fail_first_pending: bool = False,
                      random_faults: bool = True) -> CallFault | None:
    """The call fault for one call, or None to answer normally.

    Fixed faults win over random ones, in this order: `down`, `status_override`, a pending
    `fail_first_n` call, then the random rates error, 429, timeout, malformed (first hit wins).
    `random_faults=False` (used for /models) consults only `down` and `status_override`.
    """
    if faults.down:
        return CallFault.DOWN
    if faults.status_override is not None:
        return CallFault.STATUS_OVERRIDE
    if fail_first_pending:
        return CallFault.FAIL_FIRST
    if not random_faults:
        return None
    for fault, rate in ((CallFault.ERROR, faults.error_rate), (CallFault.RATE_429, faults.rate_429),
                        (CallFault.TIMEOUT, faults.timeout_rate), (CallFault.MALFORMED, faults.malformed_rate)):
        if _fires(rate, rng):
            return fault
    return None


def decide_truncate(faults: SimulatorConfig, rng: random.Random) -> bool:
    """Whether this call's reply is cut in half (reported with finish_reason "length")."""
    return _fires(faults.truncate_rate, rng)


def decide_stream_error(faults: SimulatorConfig, rng: random.Random) -> bool:
    """Whether this streamed reply ends in an error event after `stream_error_after` chunks."""
    return _fires(faults.stream_error_rate, rng)


def response_block(block_id: str, answer: str) -> str:
    """One well-formed block of a merged reply, in the form the header asks for (`<K42>answer</K42>`)."""
    return f"<{block_id}>{answer}</{block_id}>"


def garble(block: str) -> str:
    """Break a block's tags so that no parser can accept it, keeping its answer text: `<K42 >` and `</K42`."""
    head, _, rest = block.partition(">")
    body, _, tail = rest.rpartition("</")
    return f"{head} !>{body}</{tail.rstrip('>')} !"


def render_blocks(answers: Sequence[tuple[str, str]], faults: SimulatorConfig,
                  rng: random.Random) -> tuple[str, list[str]]:
    """The reply to a merged call: one block per (id, answer), joined by newlines, with block faults.

    Returns the reply text and the names of the faults applied, in the order they were applied:
    split failure (no tags at all: the answers as one paragraph), drop (one block omitted), duplicate (one block repeated right after itself), reorder (blocks
    reversed), garble (one block's tags broken), chatter (text before and after the blocks).
    """
    items = list(answers)
    applied: list[str] = []
    if items and _fires(faults.split_failure_rate, rng):
        return " ".join(answer for _, answer in items), ["split_failure"]
    if items and _fires(faults.drop_block_rate, rng):
        del items[rng.randrange(len(items))]
        applied.append("drop_block")
    if items and _fires(faults.duplicate_block_rate, rng):
        i = rng.randrange(len(items))
        items.insert(i + 1, items[i])
        applied.append("duplicate_block")
    if faults.reorder_blocks and len(items) > 1:
        items.reverse()
        applied.append("reorder_blocks")
    blocks = [response_block(block_id, answer) for block_id, answer in items]
    if blocks and _fires(faults.garble_block_rate, rng):
        i = rng.randrange(len(blocks))
        blocks[i] = garble(blocks[i])
        applied.append("garble_block")
    if faults.chatter:
        blocks = [CHATTER_BEFORE, *blocks, CHATTER_AFTER]
        applied.append("chatter")
    return "\n".join(blocks), applied


def error_response(status: int, message: str, type_: str, code: str | None,
                   headers: Mapping[str, str] | None = None) -> web.Response:
    """An error status with the OpenAI error envelope."""
    return web.json_response(error_body(message, type_, None, code), status=status, headers=headers)


def retry_after_header(seconds: float) -> dict[str, str]:
    """Retry-After as configured: whole seconds when integral ("1"), else decimal ("0.5")."""
    return {"Retry-After": str(int(seconds)) if float(seconds).is_integer() else f"{seconds:g}"}


def fault_status_response(fault: CallFault, config: SimulatorConfig) -> web.Response | None:
    """The error answer of a call fault, or None for faults that do not answer with an error status."""
    if fault is CallFault.DOWN:
        return error_response(503, "simulated upstream is down", "server_error", "simulated_down")
    if fault is CallFault.FAIL_FIRST:
        return error_response(503, "simulated failure (fail_first_n)", "server_error", "simulated_fail_first")
    if fault is CallFault.ERROR:
        return error_response(500, "simulated upstream error", "server_error", "simulated_error")
    if fault is CallFault.RATE_429 or (fault is CallFault.STATUS_OVERRIDE and config.status_override == 429):
        return error_response(429, "simulated rate limit", "rate_limit_error", "rate_limit_exceeded",
                              retry_after_header(config.retry_after_s))
    if fault is CallFault.STATUS_OVERRIDE and config.status_override is not None:
        status = config.status_override
        type_ = "invalid_request_error" if status < 500 else "server_error"
        return error_response(status, f"simulated status {status}", type_, "simulated_status")
    return None


class FaultInjector:
    """Owns the live config and the seeded RNG; decides each call's fault and acts on it.

    One per simulator. `close()` ends hanging calls at once, so shutdown never waits `hang_s`.
    """

    def __init__(self, config: SimulatorConfig) -> None:
        self._config = config
        self._rng = random.Random(config.seed)
        self._closing = asyncio.Event()

    @property
    def config(self) -> SimulatorConfig:
        """The current configuration (fault fields as changed at run time)."""
        return self._config

    @property
    def rng(self) -> random.Random:
        """The seeded RNG that block faults and truncation draw from too (one sequence per simulator)."""
        return self._rng

    def update(self, **fields: Any) -> dict[str, Any]:
        """Change fault/latency fields now; returns them all. Raises ValueError for bad fields."""
        self._config = self._config.with_runtime_fields(**fields)
        log.info("simulator_faults_changed", **fields)
        return self._config.runtime_fields()

    def close(self) -> None:
        """End hanging calls now."""
        self._closing.set()

    def take(self, *, chat: bool, random_faults: bool = True) -> CallFault | None:
        """The fault of the call arriving now (a pending `fail_first_n` counts down here)."""
        fault = decide_call_fault(self._config, self._rng, random_faults=random_faults,
                                  fail_first_pending=chat and self._config.fail_first_n > 0)
        if fault is CallFault.FAIL_FIRST:
            self._config = replace(self._config, fail_first_n=self._config.fail_first_n - 1)
        return fault

    async def act(self, fault: CallFault | None, request: web.Request, *,
                  stream: bool = False) -> web.StreamResponse | None:
        """Carry out a call fault: the response to send instead of an answer, or None to answer."""
        if fault is None:
            return None
        if fault is CallFault.TIMEOUT:
            return None if await self._hang() else error_response(503, "simulator closing", "server_error", None)
        if fault is CallFault.MALFORMED and not stream:
            return web.Response(text=MALFORMED_BODY, content_type="application/json")
        if fault is CallFault.MALFORMED:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(f"data: {MALFORMED_BODY}\n\ndata: [DONE]\n\n".encode())
            await response.write_eof()
            return response
        return fault_status_response(fault, self._config)

    async def _hang(self) -> bool:
        """Wait `hang_s` (the caller's timeout should fire first); False if closed meanwhile."""
        try:
            await asyncio.wait_for(self._closing.wait(), self._config.hang_s)
        except TimeoutError:
            return True
        return False
