"""Profile the broker's request path in-process, under cProfile or a statistical sampler.

The broker runs in this process, on the main thread's event loop; the simulator (latency 0) and the
load generator run as child processes, so every CPU second this process spends is the broker's.

    python -m bench.profile_broker [--concurrency 16] [--requests 2000] [--top 30] [--merge] [--cache]
    python -m bench.profile_broker --sample     # statistical stacks instead of cProfile

It first measures the broker's CPU per request without any profiler (the figure to compare between
changes; `--repeat N` gives N such runs), then profiles one more run and prints the top functions:
- cProfile (default): by cumulative and by own CPU time, with call counts. Its per-call cost inflates
  code made of many small Python calls several-fold, so shares are skewed towards such code.
- `--sample`: a SIGPROF timer on the process's CPU time interrupts the broker every `--interval-ms` of
  CPU and records the Python stack it was in: no call counts, but shares close to the unprofiled run.
`--out FILE` writes the raw cProfile data for `python -m pstats FILE` or snakeviz.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import signal
import sys
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

from aiohttp import web

from bench.harness import chat_request, closed_loop, passthrough_config, processes, sim_base_url, start_simulator
from bench.passthrough import body_for


@dataclass(frozen=True)
class RunStats:
    """One measured run: requests sent, how many got 200, wall seconds, broker CPU seconds."""

    requests: int
    ok: int
    wall_s: float
    cpu_s: float

    def line(self, label: str) -> str:
        """A one-line summary (throughput, CPU ms per request)."""
        per = self.cpu_s * 1000 / self.requests if self.requests else float("nan")
        return (f"{label}: {self.requests} requests ({self.ok} ok) in {self.wall_s:.2f} s = "
                f"{self.requests / self.wall_s:.0f} req/s; broker CPU {per:.3f} ms/request")


def broker_config(upstream: str, *, merge: bool, cache: bool) -> dict[str, Any]:
    """The passthrough config of `bench.passthrough`, optionally with merging and caching switched back on."""
    config = passthrough_config(upstream)
    config["merge"] = {"enabled": merge, "embedder": "none"}
    config["cache"] = {"enabled": cache}
    config["logging"] = {"level": "warning"}
    return config


async def serve_broker(config: dict[str, Any]) -> tuple[web.AppRunner, str]:
    """The broker app on 127.0.0.1 (a free port) in this loop; returns its runner and base URL."""
    from mergebroker.broker.engine.ground.config import load_settings
    from mergebroker.broker.engine.ground.logging import configure_logging
    from mergebroker.broker.http.app import create_app

    settings = load_settings(None, environ={}, overrides=config)
    configure_logging(settings.logging.level, json_lines=settings.logging.json_lines,
                      request_lines_per_s=settings.logging.request_lines_per_s)
    runner = web.AppRunner(create_app(settings), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]


async def drive(url: str, concurrency: int, requests: int, *, lone: bool = False) -> dict[str, Any]:
    """`requests` distinct chat requests at `concurrency` (in the load process); sent, ok, wall seconds.
    `lone`: the lone-request bodies of `bench.passthrough --lone` (nothing to merge, each cached)."""
    body = body_for(uuid.uuid4().hex[:8], lone=lone)
    samples, wall = await closed_loop(chat_request(url, body), concurrency=concurrency, total=requests)
    return {"sent": len(samples), "ok": sum(1 for s in samples if s.status == 200), "wall_s": wall}


async def measured(url: str, concurrency: int, requests: int, *, lone: bool = False) -> RunStats:
    """One run of the load process against `url`, with this process's CPU seconds over it."""
    cpu_before = time.process_time()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.profile_broker", "--drive", url, "--concurrency", str(concurrency),
        "--requests", str(requests), *(("--lone",) if lone else ()), stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    cpu = time.process_time() - cpu_before
    if proc.returncode != 0:
        raise RuntimeError(f"load process failed with exit status {proc.returncode}")
    result = json.loads(out)
    return RunStats(result["sent"], result["ok"], result["wall_s"], cpu)


class StackSampler:
    """Counts the Python stacks that SIGPROF (every `interval_s` of process CPU time) interrupts.

    `own` counts the innermost frame of each sample, `inclusive` every function on the stack once.
    Signal handlers run on the main thread, which is where the broker's loop runs here.
    """

    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self.samples = 0
        self.own: Counter[str] = Counter()
        self.inclusive: Counter[str] = Counter()

    def __enter__(self) -> StackSampler:
        signal.signal(signal.SIGPROF, self._sample)
        signal.setitimer(signal.ITIMER_PROF, self._interval_s, self._interval_s)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        signal.signal(signal.SIGPROF, signal.SIG_DFL)

    def _sample(self, _signum: int, frame: FrameType | None) -> None:
        if frame is None:
            return
        self.samples += 1
        self.own[_where(frame)] += 1
        seen = set()
        current: FrameType | None = frame
        while current is not None:
            seen.add(_where(current))
            current = current.f_back
        self.inclusive.update(seen)

    def report(self, limit: int) -> str:
        """Top functions by inclusive and by own share of the samples."""
        lines = [f"{self.samples} samples"]
        for title, counts in (("inclusive (on the stack)", self.inclusive), ("own (innermost frame)", self.own)):
            lines += ["", f"   share  {title}"]
            lines += [f"  {100 * n / max(1, self.samples):5.1f}%  {name}" for name, n in counts.most_common(limit)]
        return "\n".join(lines)


def _where(frame: FrameType) -> str:
    code = frame.f_code
    path = code.co_filename
    short = path.split("site-packages/")[-1] if "site-packages/" in path else "/".join(path.split("/")[-2:])
    return f"{short}:{code.co_firstlineno}({code.co_name})"


def top_functions(profiler: cProfile.Profile, sort: str, limit: int) -> str:
    """The `limit` top rows of the profile sorted by `sort` ("cumulative" or "tottime")."""
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).strip_dirs().sort_stats(sort).print_stats(limit)
    return out.getvalue()


async def profile(url: str, args: argparse.Namespace) -> None:
    """Warm up, measure unprofiled, then profile one run and print the tables."""
    await measured(url, args.concurrency, args.warmup)
    for _ in range(args.repeat):
        print((await measured(url, args.concurrency, args.requests)).line("unprofiled"), flush=True)
    if args.no_profile:
        return
    if args.sample:
        with StackSampler(args.interval_ms / 1000) as sampler:
            print((await measured(url, args.concurrency, args.requests)).line("sampled"))
        print(sampler.report(args.top))
        return
    # Timed by this process's CPU clock: waiting in select() for the load is not the broker's cost.
    profiler = cProfile.Profile(time.process_time)
    profiler.enable()
    stats = await measured(url, args.concurrency, args.requests)
    profiler.disable()
    print(stats.line("profiled"))
    print(top_functions(profiler, "cumulative", args.top))
    print(top_functions(profiler, "tottime", args.top))
    if args.out:
        profiler.dump_stats(args.out)
        print(f"wrote {args.out}")


async def session(args: argparse.Namespace) -> None:
    """The simulator, the broker in this process, and the profiling runs against it."""
    async with processes(start_simulator("--latency-base-ms", "0")) as (sim,):
        runner, url = await serve_broker(broker_config(sim_base_url(sim), merge=args.merge, cache=args.cache))
        try:
            await profile(url, args)
        finally:
            await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the broker under a profiler against the simulator and print the hottest functions."""
    parser = argparse.ArgumentParser(prog="python -m bench.profile_broker", description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=2000, help="requests per measured run")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=1, help="unprofiled runs before the profiled one")
    parser.add_argument("--top", type=int, default=30, help="rows per table")
    parser.add_argument("--merge", action="store_true", help="leave merging on (window batching, no embedder)")
    parser.add_argument("--cache", action="store_true", help="leave the response cache on")
    parser.add_argument("--no-profile", action="store_true", help="only the unprofiled CPU measurement")
    parser.add_argument("--sample", action="store_true", help="statistical stack samples instead of cProfile")
    parser.add_argument("--interval-ms", type=float, default=1.0, help="CPU ms between samples for --sample")
    parser.add_argument("--out", help="also write the raw cProfile data here")
    parser.add_argument("--drive", metavar="URL", help=argparse.SUPPRESS)  # internal: be the load process
    parser.add_argument("--lone", action="store_true", help=argparse.SUPPRESS)  # internal: with --drive
    args = parser.parse_args(argv)
    if args.drive:
        print(json.dumps(asyncio.run(drive(args.drive, args.concurrency, args.requests, lone=args.lone))))
        return 0
    asyncio.run(session(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
