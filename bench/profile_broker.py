"""Profile the broker's request path: cProfile on the broker's own thread, load from the same process.

The simulator runs as a child process (latency 0); the broker runs in-process on its own thread and
event loop; the load generator drives it from the main thread at a fixed concurrency. cProfile is
switched on in the broker's thread only, timed by that thread's CPU clock by default, so neither the
load generator nor time spent waiting for the GIL shows up in the figures.

    python -m bench.profile_broker [--concurrency 16] [--requests 2000] [--top 30] [--merge] [--cache]

It first measures the broker thread's CPU per request without the profiler (the figure to compare
between changes), then profiles a second run and prints the top functions by cumulative and own time.
`--out FILE` also writes the raw profile for `python -m pstats FILE` or snakeviz.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import sys
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from aiohttp import web

from bench.harness import chat_request, closed_loop, passthrough_config, processes, sim_base_url, start_simulator


@dataclass(frozen=True)
class RunStats:
    """One measured run: requests sent, how many got 200, wall seconds, broker-thread CPU seconds."""

    requests: int
    ok: int
    wall_s: float
    cpu_s: float

    def line(self, label: str) -> str:
        """A one-line summary (CPU ms per request, throughput)."""
        per = self.cpu_s * 1000 / self.requests if self.requests else float("nan")
        return (f"{label}: {self.requests} requests ({self.ok} ok) in {self.wall_s:.2f} s = "
                f"{self.requests / self.wall_s:.0f} req/s; broker thread CPU {per:.3f} ms/request")


class BrokerThread:
    """A broker app served on 127.0.0.1 from its own thread and event loop."""

    def __init__(self, config: dict[str, Any]) -> None:
        self._config = config
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="broker", daemon=True)
        self._runner: web.AppRunner | None = None
        self.url = ""

    def start(self) -> None:
        """Start the thread and the broker; returns once it listens."""
        self._thread.start()
        self.url = self.call(self._serve)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn()` (a coroutine function or a plain one) on the broker's thread and return its result."""
        if asyncio.iscoroutinefunction(fn):
            return asyncio.run_coroutine_threadsafe(fn(), self._loop).result()
        done: Future[Any] = Future()

        def run() -> None:
            try:
                done.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed back to the calling thread
                done.set_exception(exc)

        self._loop.call_soon_threadsafe(run)
        return done.result()

    async def _serve(self) -> str:
        from broker.app import create_app
        from broker.logging import configure_logging
        from broker.settings import load_settings

        settings = load_settings(None, environ={}, overrides=self._config)
        configure_logging(settings.logging.level, json_lines=settings.logging.json_lines)
        self._runner = web.AppRunner(create_app(settings), access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    def stop(self) -> None:
        """Clean the app up and end the thread."""
        if self._runner is not None:
            self.call(self._runner.cleanup)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


def broker_config(upstream: str, *, merge: bool, cache: bool) -> dict[str, Any]:
    """The passthrough config of `bench.passthrough`, optionally with merging and caching switched back on."""
    config = passthrough_config(upstream)
    config["merge"] = {"enabled": merge, "embedder": "none"}
    config["cache"] = {"enabled": cache}
    config["logging"] = {"level": "warning"}
    return config


async def drive(url: str, concurrency: int, requests: int) -> tuple[int, int, float]:
    """`requests` distinct chat requests at `concurrency`; returns (sent, ok, wall seconds)."""
    run_id = uuid.uuid4().hex[:8]

    def body(i: int) -> tuple[dict[str, Any], dict[str, str], str]:
        text = f"profile {run_id} request {i}: what is {i} squared?"
        return {"model": "sim-small", "messages": [{"role": "user", "content": text}]}, {}, ""

    samples, wall = await closed_loop(chat_request(url, body), concurrency=concurrency, total=requests)
    return len(samples), sum(1 for s in samples if s.status == 200), wall


def measured(broker: BrokerThread, concurrency: int, requests: int,
             profiler: cProfile.Profile | None = None) -> RunStats:
    """One run; the broker thread's CPU clock is read on that thread before and after."""
    if profiler is not None:
        broker.call(profiler.enable)  # sys.setprofile is per thread: enable it on the broker's
    cpu_before = broker.call(time.thread_time)
    sent, ok, wall = asyncio.run(drive(broker.url, concurrency, requests))
    cpu_after = broker.call(time.thread_time)
    if profiler is not None:
        broker.call(profiler.disable)
    return RunStats(sent, ok, wall, cpu_after - cpu_before)


def top_functions(profiler: cProfile.Profile, sort: str, limit: int) -> str:
    """The `limit` top rows of the profile sorted by `sort` ("cumulative" or "tottime")."""
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.strip_dirs().sort_stats(sort).print_stats(limit)
    return out.getvalue()


async def _with_simulator(fn: Callable[[str], None]) -> None:
    async with processes(start_simulator("--latency-base-ms", "0")) as (sim,):
        await asyncio.to_thread(fn, sim_base_url(sim))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the broker under cProfile against the simulator and print the hottest functions."""
    parser = argparse.ArgumentParser(prog="python -m bench.profile_broker", description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=2000, help="requests per measured run")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--top", type=int, default=30, help="rows per table")
    parser.add_argument("--timer", choices=("cpu", "wall"), default="cpu",
                        help="cpu: the broker thread's CPU clock (default); wall: perf_counter")
    parser.add_argument("--merge", action="store_true", help="leave merging on (window batching, no embedder)")
    parser.add_argument("--cache", action="store_true", help="leave the response cache on")
    parser.add_argument("--no-profile", action="store_true", help="only the unprofiled CPU measurement")
    parser.add_argument("--out", help="also write the raw profile here")
    args = parser.parse_args(argv)

    def session(upstream: str) -> None:
        broker = BrokerThread(broker_config(upstream, merge=args.merge, cache=args.cache))
        broker.start()
        try:
            measured(broker, args.concurrency, args.warmup)
            print(measured(broker, args.concurrency, args.requests).line("unprofiled"))
            if args.no_profile:
                return
            profiler = cProfile.Profile(time.thread_time if args.timer == "cpu" else time.perf_counter)
            print(measured(broker, args.concurrency, args.requests, profiler).line("profiled"))
        finally:
            broker.stop()
        print(top_functions(profiler, "cumulative", args.top))
        print(top_functions(profiler, "tottime", args.top))
        if args.out:
            profiler.dump_stats(args.out)
            print(f"wrote {args.out}")

    asyncio.run(_with_simulator(session))
    return 0


if __name__ == "__main__":
    sys.exit(main())
