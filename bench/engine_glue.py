"""The broker's own work per chat request, without HTTP: the in-process library over an instant upstream.

`bench.components` splits a passthrough request's CPU by component over real HTTP, where aiohttp's server and
client are more than half of it and the shared host's noise is large. This measures the rest alone: the
in-process `Broker` (the path an HTTP request takes after its body is read: validation, admission and limits,
fingerprint, coalescing, the queue's send-now path, dispatch, pool, breaker, usage, metrics, ledger and the
request log at its default sampling) with each upstream's provider answering at once in this process (one
loop turn, as a real call suspends once). Merging and cache are off, as in passthrough. What it prints is
CPU microseconds per request, best of `--rounds` runs; with `--old-checkout PATH` the two builds run in
alternating child processes and the ratio old/new is printed beside them (above 1: this build does less).

    python -m bench.engine_glue [--requests 5000] [--rounds 5] [--old-checkout PATH] [--lone] [--profile N] [--out FILE]

`--lone` adds the lone-request path: the broker at its defaults (merging, cache, default tiers) on requests that
each carry their own system prompt and temperature 0 (none can merge; each is looked up in and written to the
cache), reported against passthrough (`lone / passthrough`).

`--profile N` also prints this build's N functions with the most own time under cProfile (inflated by the
profiler about threefold, so read them as shares).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.harness import old_checkout_path, publish, results_path, run_meta

REPLY = {"id": "chatcmpl-glue", "object": "chat.completion", "created": 1, "model": "sim-small",
         "choices": [{"index": 0, "message": {"role": "assistant", "content": "The answer is 289."},
                      "finish_reason": "stop"}],
         "usage": {"prompt_tokens": 20, "completion_tokens": 6, "total_tokens": 26}}
PROVIDERS = [{"name": "sim", "base_url": "http://127.0.0.1:9/v1"}]  # never dialled: answered in-process
CONFIG = {"providers": PROVIDERS, "merge": {"enabled": False}, "cache": {"enabled": False}}
LONE_CONFIG = {"providers": PROVIDERS}


class InstantProvider:
    """The upstream's stand-in: answers every chat call after one loop turn, so only the broker's work is timed."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.native_apis: frozenset[str] = frozenset()

    async def chat(self, body: dict[str, Any], *, timeout: float) -> dict[str, Any]:
        await asyncio.sleep(0)
        return {**REPLY, "model": body["model"]}

    async def close(self) -> None:
        return None


def _body(i: int, lone: bool = False) -> dict[str, Any]:
    question = {"role": "user", "content": f"glue question {i}: what is {i} squared?"}
    if lone:
        return {"model": "sim-small", "temperature": 0,
                "messages": [{"role": "system", "content": f"You answer arithmetic, case {i}."}, question]}
    return {"model": "sim-small", "messages": [question]}


async def _background_settled(timeout_s: float = 300.0) -> None:
    """Wait until the process's own threads are idle: at the defaults the similarity model loads (and is checked)
    on a thread of its own after start-up, and CPU time counts every thread of the process."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        before = time.process_time()
        await asyncio.sleep(0.5)
        if time.process_time() - before < 0.01:
            return


async def _measure(requests: int, profile_top: int, lone: bool = False) -> dict[str, Any]:
    from mergebroker.broker.engine.ground.logging import configure_logging
    from mergebroker.broker.library import Broker

    configure_logging("info", json_lines=True, request_lines_per_s=100)  # as `mergebroker serve` logs by default
    async with Broker.from_settings(LONE_CONFIG if lone else CONFIG) as broker:
        for upstream in broker.engine.pools.upstreams:
            upstream.provider = InstantProvider(upstream.name)  # type: ignore[assignment]
        for i in range(1000):  # warm code paths and memos
            await broker.chat(_body(-i - 1, lone))
        await _background_settled()
        started = time.process_time()
        for i in range(requests):
            await broker.chat(_body(i, lone))
        result: dict[str, Any] = {"us_per_request": (time.process_time() - started) * 1e6 / requests}
        if profile_top:
            profiler = cProfile.Profile(time.process_time)
            profiler.enable()
            for i in range(requests):
                await broker.chat(_body(requests + i, lone))
            profiler.disable()
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).strip_dirs().sort_stats("tottime").print_stats(profile_top)
            result["profile"] = out.getvalue()
    return result


def _child(pythonpath: Path | None, requests: int, profile_top: int = 0, lone: bool = False) -> dict[str, Any]:
    """One measurement in a fresh process (another checkout's broker where `pythonpath` is set)."""
    env = None
    if pythonpath is not None:
        env = {**os.environ, "PYTHONPATH": f"{pythonpath}:{Path(__file__).resolve().parent.parent}"}
    done = subprocess.run([sys.executable, "-m", "bench.engine_glue", "--child", "--requests", str(requests),
                           "--profile", str(profile_top), *(["--lone"] if lone else [])], capture_output=True,
                          env=env, check=True)
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


def run(requests: int, rounds: int, old: Path | None, profile_top: int, lone: bool = False) -> dict[str, Any]:
    """Alternating rounds of this build (and the old one, and the lone path); the best round of each, and ratios."""
    builds: dict[str, list[float]] = {"new": [], **({"old": []} if old else {}), **({"lone": []} if lone else {})}
    # This build is imported the way the old one is (its folders mapped as setup.py maps them), so both pay the
    # same for their imports, whatever this interpreter's own install of mergebroker is (an editable one measured
    # ~10% slower per request).
    this = old_checkout_path(Path(__file__).resolve().parent.parent)
    for _ in range(rounds):
        for name in builds:
            builds[name].append(_child(old if name == "old" else this, requests, lone=name == "lone")["us_per_request"])
    result: dict[str, Any] = {"requests": requests, "rounds": rounds,
                              "best_us_per_request": {name: min(v) for name, v in builds.items()},
                              "rounds_us_per_request": builds}
    if old is not None:
        result["old_over_new"] = result["best_us_per_request"]["old"] / result["best_us_per_request"]["new"]
    if lone:
        result["lone_over_passthrough"] = result["best_us_per_request"]["lone"] / result["best_us_per_request"]["new"]
    if profile_top:
        result["profile"] = _child(this, requests, profile_top)["profile"]
    return result


def report(result: dict[str, Any]) -> str:
    lines = [f"{name}: {us:.1f} us of CPU per request (best of {result['rounds']} x {result['requests']})"
             for name, us in result["best_us_per_request"].items()]
    if "old_over_new" in result:
        lines.append(f"old / new: {result['old_over_new']:.2f}x")
    if "lone_over_passthrough" in result:
        lines.append(f"lone / passthrough: {result['lone_over_passthrough']:.2f}x")
    if "profile" in result:
        lines += ["", result["profile"]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engine_glue", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--old-checkout", type=Path, help="another checkout to run side by side")
    parser.add_argument("--profile", type=int, default=0, help="print the top N functions by own time")
    parser.add_argument("--lone", action="store_true", help="also the lone-request path at the defaults")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.child:
        from mergebroker.eventloop import new_event_loop
        with asyncio.Runner(loop_factory=new_event_loop) as runner:  # the loop `mergebroker serve` runs on
            print(json.dumps(runner.run(_measure(args.requests, args.profile, args.lone))))
        return 0
    started = time.perf_counter()
    old = old_checkout_path(args.old_checkout) if args.old_checkout else None
    result = run(args.requests, args.rounds, old, 0 if args.child else args.profile, args.lone)
    result["meta"] = run_meta(started)
    publish(result, report(result), args.out or str(results_path("engine_glue.json")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
