"""Python bytecodes executed per request, by module and function: the broker's and the minimal proxy's, exactly.

`bench.instructions` counts each server's machine instructions under callgrind, where the Python interpreter
is one opaque loop. This counts what that loop ran: the server runs in this process (the broker in passthrough,
or the proxy), the simulator and the load generator are child processes, and a trace function switched on only
around the measured requests counts every bytecode, charged to the function that executed it (its own work,
not its callees'). The count is the same on a quiet host and a busy one and takes about a minute, so it shows
at once which function a change made cheaper; it weighs every bytecode alike (a call into C, such as orjson's,
counts as one), so it stands beside the instruction counts rather than replacing them. The trace slows the
server about fiftyfold, so the request log's sampling (100 lines a second) writes every line here.

    python -m bench.bytecodes [--requests 300] [--concurrency 1] [--top 40] [--lone] [--out FILE]

The report gives each target's total, then the modules and the functions with the most of the broker's own
bytecodes, the `__init__`s its dataclasses generate counted as one module (aiohttp, the standard library and the
other dependencies are left out of those two tables: the proxy runs them too). `--lone` counts the broker at its
defaults (merging, cache and the default tiers on) with nothing to merge instead, the lone-request bodies of
`bench.passthrough --lone`, and reports it against the passthrough broker too.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from aiohttp import web

from bench.harness import (
    format_table,
    passthrough_config,
    processes,
    publish,
    results_path,
    run_meta,
    sim_base_url,
    start_simulator,
)
from bench.profile_broker import measured, serve_broker
from bench.proxy_baseline import create_proxy_app

WARMUP = 300
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)


class BytecodeCounter:
    """Counts the bytecodes this thread executes while on, per (file, function)."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()

    def _trace(self, frame: FrameType, event: str, _arg: Any) -> Any:
        frame.f_trace_opcodes = True
        if event == "opcode":
            code = frame.f_code
            self.counts[(code.co_filename, code.co_qualname)] += 1  # `Pool.chat`, not `chat`
        return self._trace

    def __enter__(self) -> BytecodeCounter:
        sys.settrace(self._trace)
        return self

    def __exit__(self, *_: object) -> None:
        sys.settrace(None)


def own_module(filename: str) -> str | None:
    """The broker's module a file is (relative to the package, e.g. `providers/pool.py`), else None."""
    if filename == "<string>":  # the `__init__`s dataclasses generate (the broker's records and jobs)
        return "<dataclass>"
    marker = "/mergebroker/"
    if marker in filename:
        return filename.split(marker, 1)[1]
    if filename.startswith(_PACKAGE_ROOT + "/") and "/site-packages/" not in filename:
        return filename[len(_PACKAGE_ROOT) + 1:]
    return None


async def _serve_proxy(upstream: str) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(create_proxy_app(upstream), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]


async def count(target: str, upstream: str, requests: int, concurrency: int) -> Counter[tuple[str, str]]:
    """Serve `target` ("proxy", "broker" in passthrough, or "lone": the broker at its defaults) in this process,
    warm it, and count `requests` requests."""
    lone = target == "lone"
    if target == "proxy":
        runner, url = await _serve_proxy(upstream)
    elif lone:
        runner, url = await serve_broker({"providers": [{"name": "sim", "base_url": upstream}]})
    else:
        runner, url = await serve_broker(passthrough_config(upstream))
    try:
        await measured(url, concurrency, WARMUP, lone=lone)
        with BytecodeCounter() as counter:
            stats = await measured(url, concurrency, requests, lone=lone)
        if stats.ok != requests:
            raise RuntimeError(f"{target}: {requests - stats.ok} of {requests} requests failed")
    finally:
        await runner.cleanup()
    return counter.counts


async def run(requests: int, concurrency: int, top: int, lone: bool = False) -> dict[str, Any]:
    started = time.perf_counter()
    async with processes(start_simulator("--latency-base-ms", "0")) as (sim,):
        upstream = sim_base_url(sim)
        proxy = await count("proxy", upstream, requests, concurrency)
        broker = await count("broker", upstream, requests, concurrency)
        lone_broker = await count("lone", upstream, requests, concurrency) if lone else None
    passthrough_total = sum(broker.values()) / float(requests)
    if lone_broker is not None:
        broker = lone_broker
    modules: Counter[str] = Counter()
    functions: Counter[str] = Counter()
    for (filename, name), n in broker.items():
        module = own_module(filename)
        if module is not None:
            modules[module] += n
            functions[module if module == "<dataclass>" else f"{module}:{name}"] += n
    per = float(requests)
    totals = {"proxy": sum(proxy.values()) / per, "broker": sum(broker.values()) / per}
    if lone_broker is not None:
        totals["passthrough"] = passthrough_total
    return {"requests": requests, "concurrency": concurrency, "lone": lone, "bytecodes_per_request": totals,
            "broker_vs_proxy": totals["broker"] / totals["proxy"],
            "broker_own_per_request": sum(modules.values()) / per,
            "modules": [{"module": m, "per_request": round(n / per)} for m, n in modules.most_common(top)],
            "functions": [{"function": f, "per_request": round(n / per)} for f, n in functions.most_common(top)],
            "meta": run_meta(started)}


def report(result: dict[str, Any]) -> str:
    totals = result["bytecodes_per_request"]
    lone = (f"   (at its defaults, lone requests; passthrough: {totals['passthrough']:.0f}, lone / passthrough: "
            f"{totals['broker'] / totals['passthrough']:.2f}x)") if result.get("lone") else ""
    return "\n".join([
        f"Python bytecodes per request ({result['requests']} requests at concurrency {result['concurrency']}; "
        "the server's own thread)",
        f"proxy: {totals['proxy']:.0f}   broker: {totals['broker']:.0f}   broker / proxy: "
        f"{result['broker_vs_proxy']:.2f}x   of which the broker's own modules: "
        f"{result['broker_own_per_request']:.0f}{lone}",
        "", format_table(result["modules"], ["module", "per_request"]),
        "", format_table(result["functions"], ["function", "per_request"]),
    ])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bytecodes", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--top", type=int, default=40, help="modules and functions listed")
    parser.add_argument("--lone", action="store_true", help="count the broker at its defaults with lone requests")
    parser.add_argument("--out", help="JSON output file")
    args = parser.parse_args(argv)
    from mergebroker.eventloop import new_event_loop

    with asyncio.Runner(loop_factory=new_event_loop) as runner:  # the loop `mergebroker serve` runs on
        result = runner.run(run(args.requests, args.concurrency, args.top, args.lone))
    publish(result, report(result), args.out or str(results_path("bytecodes_lone.json" if args.lone else "bytecodes.json")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
