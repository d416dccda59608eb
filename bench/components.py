"""Where a passthrough request's CPU goes: the broker's CPU per request split by component, beside the minimal
proxy's whole CPU per request, at concurrency 1 and 64 (the profile issue 36 asks for).

The broker runs in this process, on the loop `mergebroker serve` picks (uvloop where installed), at its default logging (info: the request log sampled past 100 lines a second);
the simulator, the proxy and the load generator are child processes. A statistical sampler (SIGPROF every
`--interval-ms` of this process's CPU) records the stack of each sample; a sample is charged to the innermost
frame that belongs to a component (`COMPONENTS`: module paths, most specific first). Frames of the standard
library and asyncio's transports are charged to the component that called them; what only the event loop ran
is "event loop". Shares times the unprofiled CPU per request give microseconds per request. The collector's
passes in the unprofiled run are counted apart (`GcWatch`): their CPU grows with the requests in flight, which
is where a broker's CPU per request grew from concurrency 16 to 64 (`mergebroker.gc_policy`).

    python -m bench.components [--requests 3000] [--concurrency 1,64] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import time
from collections import Counter
from collections.abc import Sequence
from types import FrameType
from typing import Any

from bench.harness import (
    CpuWindow,
    chat_request,
    closed_loop,
    format_table,
    passthrough_config,
    processes,
    publish,
    results_path,
    run_meta,
    sim_base_url,
    start_proxy,
    start_simulator,
)
from bench.profile_broker import StackSampler, measured, serve_broker
from mergebroker.eventloop import loop_kind, new_event_loop

COMPONENTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("metrics", ("prometheus_client/", "engine/ground/metrics.py")),
    ("logging", ("structlog/", "engine/ground/logging.py")),
    ("ledger and accounting", ("engine/accounting/",)),
    ("tracing (off)", ("core/tracing.py", "providers/attempt_trace.py", "http/tracing.py")),
    ("parsing and validation", ("pydantic", "engine/ground/schemas.py", "http/body.py", "core/jsonio.py",
                                "apis/", "tool_shapes.py")),
    ("token counting", ("engine/ground/tokens.py", "bpe_openai", "tiktoken")),
    ("fingerprint and merge rules", ("merge/fingerprint.py", "merge/mergeable.py", "merge/shape.py",
                                     "core/output_budget.py")),
    ("admission and limits", ("engine/limits/",)),
    ("breaker", ("breaker/",)),
    ("pool (retries, failover, slots)", ("providers/pool.py", "providers/upstream.py", "providers/retry.py",
                                         "providers/pacing.py", "providers/token_bucket.py")),
    ("provider wire (our side)", ("providers/openai/", "providers/sse.py", "providers/whole_reply.py",
                                  "core/token_usage.py")),
    ("chat service (cache, coalescing, queue, dispatch)", ("engine/chat/", "merge/coalesce.py", "merge/cache.py")),
    ("handlers", ("http/routes.py", "engine/handling.py", "http/api_routes.py")),
    ("middleware, drain, connection guard", ("http/middleware.py", "http/drain.py", "http/connections.py",
                                             "http/server.py")),
    ("upstream client", ("providers/http1_client.py", "httptools", "aiohttp/client", "aiohttp/connector.py")),
    ("server (aiohttp)", ("aiohttp/web", "aiohttp/http_parser.py", "aiohttp/_http_parser", "aiohttp/base_protocol")),
)
EVENT_LOOP = "event loop"


def component_of(frame: FrameType | None) -> str:
    """The component a sample's stack is charged to: its innermost frame that belongs to one."""
    while frame is not None:
        path = frame.f_code.co_filename
        for name, parts in COMPONENTS:
            if any(part in path for part in parts):
                return name
        frame = frame.f_back
    return EVENT_LOOP


class ComponentSampler(StackSampler):
    """`StackSampler` that also counts samples by component."""

    def __init__(self, interval_s: float) -> None:
        super().__init__(interval_s)
        self.components: Counter[str] = Counter()

    def _sample(self, signum: int, frame: FrameType | None) -> None:
        super()._sample(signum, frame)
        if frame is not None:
            self.components[component_of(frame)] += 1


class GcWatch:
    """Counts the cycle collector's passes in this process while entered, by generation, with their CPU time."""

    def __init__(self) -> None:
        self.passes = [0, 0, 0]
        self.cpu_s = 0.0
        self._started = 0.0

    def _seen(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.process_time()
        else:
            self.passes[info["generation"]] += 1
            self.cpu_s += time.process_time() - self._started

    def __enter__(self) -> GcWatch:
        gc.callbacks.append(self._seen)
        return self

    def __exit__(self, *_: object) -> None:
        gc.callbacks.remove(self._seen)


async def proxy_cpu_ms(proxy_url: str, proxy: Any, concurrency: int, requests: int) -> float:
    """The minimal proxy's CPU milliseconds per request under the same load."""
    def body(i: int) -> tuple[dict[str, Any], dict[str, str], str]:
        return {"model": "sim-small", "messages": [{"role": "user", "content": f"proxy {i}: what is {i}?"}]}, {}, ""

    send = chat_request(proxy_url, body)
    await closed_loop(send, concurrency=concurrency, total=min(200, requests))
    window = CpuWindow(proxy)
    samples, _ = await closed_loop(send, concurrency=concurrency, total=requests)
    return window.ms_per(len(samples))


async def run(concurrencies: Sequence[int], requests: int, interval_ms: float) -> dict[str, Any]:
    """Per concurrency: the broker's unprofiled CPU per request, its split by component, the proxy's total."""
    config = passthrough_config("")  # the upstream is filled in below
    result: dict[str, Any] = {"levels": []}
    async with processes(start_simulator("--latency-base-ms", "0")) as (sim,):
        config["providers"][0]["base_url"] = sim_base_url(sim)
        runner, url = await serve_broker(config)
        try:
            async with processes(start_proxy(sim_base_url(sim))) as (proxy,):
                for concurrency in concurrencies:
                    await measured(url, concurrency, min(300, requests))  # warm code paths and pools
                    with GcWatch() as collector:
                        plain = await measured(url, concurrency, requests)
                    sampler = ComponentSampler(interval_ms / 1000)
                    with sampler:
                        await measured(url, concurrency, requests)
                    per_ms = plain.cpu_s * 1000 / plain.requests
                    total = max(1, sampler.samples)
                    rows = [{"component": name, "share_pct": 100 * n / total, "us_per_request": 1000 * per_ms * n / total}
                            for name, n in sampler.components.most_common()]
                    result["levels"].append({
                        "concurrency": concurrency, "broker_cpu_ms_per_request": per_ms,
                        "broker_rps": plain.requests / plain.wall_s, "samples": sampler.samples, "components": rows,
                        "gc_passes": collector.passes, "gc_us_per_request": 1e6 * collector.cpu_s / plain.requests,
                        "proxy_cpu_ms_per_request": await proxy_cpu_ms(proxy.url, proxy, concurrency, requests)})
        finally:
            await runner.cleanup()
    return result


def report(result: dict[str, Any]) -> str:
    """One table per concurrency, the proxy's total beneath it."""
    lines = [f"event loop: {result.get('event_loop', 'asyncio')}"]
    for level in result["levels"]:
        lines += [f"concurrency {level['concurrency']}: broker {1000 * level['broker_cpu_ms_per_request']:.0f} us of "
                  f"CPU per request ({level['broker_rps']:.0f} req/s, {level['samples']} samples)",
                  format_table(level["components"], ["component", "share_pct", "us_per_request"]),
                  "garbage collector (in the components above): {} young / {} middle / {} full passes, {:.1f} us per "
                  "request".format(*level.get("gc_passes", (0, 0, 0)), level.get("gc_us_per_request", 0.0)),
                  f"minimal proxy, all of it: {1000 * level['proxy_cpu_ms_per_request']:.0f} us per request", ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the profile at each concurrency and print the component tables."""
    parser = argparse.ArgumentParser(prog="python -m bench.components", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=3000, help="requests per measured run")
    parser.add_argument("--concurrency", default="1,64", help="comma-separated levels (default: %(default)s)")
    parser.add_argument("--interval-ms", type=float, default=0.5, help="CPU ms between samples")
    parser.add_argument("--out", help="JSON output file")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    with asyncio.Runner(loop_factory=new_event_loop) as runner:  # the loop `mergebroker serve` runs on (uvloop)
        result = runner.run(run([int(c) for c in args.concurrency.split(",")], args.requests, args.interval_ms))
        result["event_loop"] = loop_kind(runner.get_loop())
    result["meta"] = run_meta(started)
    publish(result, report(result), args.out or str(results_path("components.json")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
