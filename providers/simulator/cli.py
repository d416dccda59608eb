"""The `mergebroker simulate` command: its options, the SimulatorConfig they describe, and serving it."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import structlog

from mergebroker.providers.simulator.server import start_simulator
from mergebroker.providers.simulator.faults import SimulatorConfig

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
    ("reorder_blocks", bool, "merged calls: answer the blocks in reverse order"),
    ("chatter", bool, "merged calls: add chatter before and after the blocks"),
    ("down", bool, "answer every call with 503"),
    ("status_override", int, "answer every call with this HTTP status"),
    ("fail_first_n", int, "fail the first N chat calls with 503"),
    ("quiz", bool, "answer the built-in question set of `mergebroker eval` correctly"),
    ("merge_degrade", float, "merged calls: each answer is wrong with probability this x (batch size - 1)"),
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
