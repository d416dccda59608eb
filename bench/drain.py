"""Drain under long streams: SIGTERM to a real `mergebroker serve` while N agent-like streams of about a minute
each are open, with `server.drain_timeout_s` above their length.

Counted: streams that finished whole (their `data: [DONE]`, no cut connection), what `/readyz` and a new
request got while draining, and when the process exited after the signal. The upstream is the simulator,
streaming its answer token by token (`--latency-per-token-ms`), as a model generating at that pace would.

    python -m bench.drain [--quick] [--streams 100] [--stream-s 60] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from bench.harness import processes, publish, results_path, run_meta, sim_base_url, start_broker, start_simulator

WORDS = 120  # the simulator's answer: about this many tokens, streamed one by one


async def stream_one(http: aiohttp.ClientSession, url: str, i: int, started: asyncio.Event) -> dict[str, Any]:
    """One streaming request read to its end: whether it ended with [DONE], and how the connection ended."""
    body = {"model": "sim-small", "stream": True, "max_tokens": 4 * WORDS,
            "messages": [{"role": "user", "content": f"agent step {i}: explain the plan in detail"}]}
    try:
        async with http.post(url + "/v1/chat/completions", json=body) as resp:
            seen = b""
            async for chunk in resp.content.iter_any():
                seen += chunk
                started.set()
            return {"status": resp.status, "done": seen.rstrip().endswith(b"data: [DONE]"), "error": None}
    except (aiohttp.ClientError, TimeoutError) as exc:
        return {"status": 0, "done": False, "error": type(exc).__name__}


async def run(streams: int, stream_s: float) -> dict[str, Any]:
    """Open `streams` streams of about `stream_s` seconds, SIGTERM the broker, and count what finished."""
    per_token_ms = 1000 * stream_s / WORDS
    started_at = time.perf_counter()
    async with processes(start_simulator("--answer-words", str(WORDS), "--latency-per-token-ms",
                                         f"{per_token_ms:g}")) as (sim,):
        config = {"providers": [{"name": "sim", "base_url": sim_base_url(sim)}], "merge": {"enabled": False},
                  "server": {"drain_timeout_s": stream_s * 1.5 + 10}}
        broker = await start_broker(config)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=stream_s * 3 + 60),
                                             connector=aiohttp.TCPConnector(limit=0)) as http:
                firsts = [asyncio.Event() for _ in range(streams)]
                tasks = [asyncio.ensure_future(stream_one(http, broker.url, i, firsts[i])) for i in range(streams)]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 120)
                signalled = time.perf_counter()
                broker.proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.5)  # the signal's handler runs in the broker's loop: let it begin
                async with http.get(broker.url + "/readyz") as resp:
                    ready = {"status": resp.status, **(await resp.json(content_type=None))}
                async with http.post(broker.url + "/v1/chat/completions", json={
                        "model": "sim-small", "messages": [{"role": "user", "content": "new"}]}) as resp:
                    refused = {"status": resp.status, "code": ((await resp.json(content_type=None)).get("error")
                                                              or {}).get("code"), "retry_after": resp.headers.get(
                                                                  "Retry-After")}
                results = await asyncio.gather(*tasks)
                finished_s = time.perf_counter() - signalled
            exit_code = await asyncio.to_thread(broker.proc.wait, stream_s * 2 + 60)
            exited_s = time.perf_counter() - signalled
        finally:
            if broker.proc.poll() is None:
                broker.stop()
    return {"streams": streams, "stream_s": stream_s, "drain_timeout_s": config["server"]["drain_timeout_s"],
            "finished_whole": sum(r["done"] for r in results), "cut": sum(1 for r in results if r["error"]),
            "errors": sorted({r["error"] for r in results if r["error"]}), "readyz_while_draining": ready,
            "new_request_while_draining": refused, "streams_done_after_signal_s": finished_s,
            "exited_after_signal_s": exited_s, "exit_code": exit_code, "meta": run_meta(started_at)}


def report(result: dict[str, Any]) -> str:
    r = result
    return "\n".join([
        f"{r['streams']} streams of ~{r['stream_s']:g} s, SIGTERM once all were streaming, drain_timeout_s "
        f"{r['drain_timeout_s']:g}",
        f"finished whole: {r['finished_whole']} of {r['streams']}; cut: {r['cut']} {r['errors'] or ''}",
        f"/readyz while draining: {r['readyz_while_draining']}",
        f"a new request while draining: {r['new_request_while_draining']}",
        f"streams done {r['streams_done_after_signal_s']:.1f} s after the signal; the process exited "
        f"{r['exited_after_signal_s']:.1f} s after it (status {r['exit_code']})"])


def main(argv: Sequence[str] | None = None) -> int:
    """Run the drain scenario and print what finished."""
    parser = argparse.ArgumentParser(prog="python -m bench.drain", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 streams of 3 s (a smoke run)")
    parser.add_argument("--streams", type=int, default=100)
    parser.add_argument("--stream-s", type=float, default=60.0, help="about how long each stream lasts")
    parser.add_argument("--out", help="JSON output file")
    args = parser.parse_args(argv)
    streams, stream_s = (10, 3.0) if args.quick else (args.streams, args.stream_s)
    result = asyncio.run(run(streams, stream_s))
    publish(result, report(result), args.out or str(results_path("drain.json")))
    return 0 if result["finished_whole"] == streams else 1


if __name__ == "__main__":
    sys.exit(main())
