"""The `mergebroker simulate` command: its options, the SimulatorConfig they describe, and serving it.

Every option but --host, --port, --models, --seed and --embedding-dim can also be changed while it runs:
`POST /control/faults` with the field names (underscores), e.g. `{"billing": "openai", "ignore_stream": true}`.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import structlog

from mergebroker.providers.simulator.faults import BILLING_MODES, CACHE_SCOPES, STREAM_ERROR_STATUSES, SimulatorConfig
from mergebroker.providers.simulator.server import start_simulator

log = structlog.get_logger(__name__)

DEFAULT_PORT = 8001

__all__ = ["DEFAULT_PORT", "add_simulate_arguments", "config_from_args", "serve_simulator"]


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
    ("split_failure_rate", float, "merged calls: probability the model ignores the tags and answers in plain prose"),
    ("reorder_blocks", bool, "merged calls: answer the blocks in reverse order"),
    ("chatter", bool, "merged calls: add chatter before and after the blocks"),
    ("down", bool, "answer every call with 503"),
    ("status_override", int, "answer every call with this HTTP status"),
    ("fail_first_n", int, "fail the first N chat calls with 503"),
    ("quiz", bool, "answer the built-in question set of `mergebroker eval` correctly"),
    ("merge_degrade", float, "merged calls: each answer is wrong with probability this x (batch size - 1)"),
    ("billing", str, ("'openai': keep OpenAI's automatic prompt cache (prefixes of 1,024+ tokens in 128-token "
                      "steps) and report usage.prompt_tokens_details.cached_tokens; the bill is at GET /_sim/bill")),
    ("cache_scope", str, "billing openai: one prompt cache per API key ('key') or one for all ('global')"),
    ("cache_ttl_s", float, "billing openai: seconds a cached prefix lives after its last use"),
    ("price_input", float, "bill: USD per million uncached prompt tokens"),
    ("price_cached_input", float, "bill: USD per million cached prompt tokens"),
    ("price_output", float, "bill: USD per million completion tokens"),
    ("token_scale", float, "count tokens this many times o200k_base's (1.3: 30%% more) in usage and the bill"),
    ("ignore_stream", bool, "answer streamed requests with a plain chat.completion JSON body"),
    ("reject_stream_options", bool, "answer 400 invalid_request_error to a request with stream_options"),
    ("reject_stream", bool, "answer 400 invalid_request_error to a request with stream: true"),
    ("stream_error_rate", float, ("probability that a stream ends with an error event after "
                                  "--stream-error-after chunks (no [DONE])")),
    ("stream_error_after", int, "chunks sent before a mid-stream error, the role chunk included"),
    ("stream_error_status", int, "shape of a mid-stream error: 429 rate_limit_exceeded or 529 overloaded_error"),
)
_CHOICES: dict[str, tuple[Any, ...]] = {"billing": BILLING_MODES, "cache_scope": CACHE_SCOPES,
                                        "stream_error_status": STREAM_ERROR_STATUSES}


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    """The `mergebroker simulate` options: where to listen, models, latency, faults, billing and streaming."""
    defaults = SimulatorConfig()
    parser.epilog = ("Every option but --host, --port, --models, --seed and --embedding-dim also changes while it "
                     "runs: POST /control/faults with a JSON object of the fields (underscores), e.g. "
                     '{"billing": "openai", "stream_error_rate": 0.5}. GET /stats shows the counters and the bill; '
                     "GET /_sim/bill the bill alone, POST /_sim/bill/reset zeroes it and empties the prompt cache.")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on, 0 for any (default: %(default)s)")
    parser.add_argument("--models", default=",".join(defaults.models),
                        help="comma-separated model names for /v1/models (default: %(default)s)")
    for name, kind, help_text in _CLI_OPTIONS:
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, action="store_true", help=help_text)
        else:
            parser.add_argument(flag, type=kind, default=getattr(defaults, name), choices=_CHOICES.get(name),
                                help=help_text + " (default: %(default)s)")
    parser.add_argument("--no-responses", dest="responses", action="store_false",
                        help="chat-only: answer POST /v1/responses with 404, as many OpenAI-compatible servers do")


def config_from_args(ns: argparse.Namespace) -> SimulatorConfig:
    """The SimulatorConfig of parsed `simulate` options; options missing from `ns` keep their defaults."""
    defaults = SimulatorConfig()
    models = tuple(m.strip() for m in str(getattr(ns, "models", "") or "").split(",") if m.strip())
    values = {name: getattr(ns, name, getattr(defaults, name)) for name, _, _ in _CLI_OPTIONS}
    values["responses"] = getattr(ns, "responses", defaults.responses)
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
