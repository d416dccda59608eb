"""Instructions per request: the broker's and the minimal proxy's, counted exactly under callgrind.

`bench.passthrough` times the broker against the minimal proxy on the shared host, where the same build's
ratio moved from 0.58x to 0.86x between runs. This counts what each server executes instead: every target
runs under `valgrind --tool=callgrind` with its instrumentation switched on only around the measured
requests (start-up and warm-up run uninstrumented, several times faster), the simulator and the load
generator run natively, and the figure is the server process's instructions per request. The count is the
same on a quiet host and a busy one, so a change of a few percent shows at once; it weighs every
instruction alike (a cache miss or a system call counts as what it executes), so it stands beside the timed
benchmarks rather than replacing them.

    python -m bench.instructions [--requests 400] [--concurrency 16] [--old-checkout PATH] [--lone] [--out FILE]

Targets: the proxy (`bench.proxy_baseline`), the broker in passthrough (merging and cache off), another
checkout's broker (`--old-checkout`, side by side), and the broker at its defaults on requests that cannot
merge (`--lone`: merging, cache and the default tiers on, each request with its own system prompt). At the
rate a program runs under callgrind (tens of requests a second) the request log's sampling (100 lines a
second) writes every line, so the broker's figures carry one `request` line per request; at thousands of
requests a second a few percent of that is left.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench.harness import (
    Process,
    _wait_http,
    chat_request,
    closed_loop,
    format_table,
    free_port,
    old_checkout_path,
    passthrough_config,
    processes_together,
    publish,
    results_path,
    run_meta,
    sim_base_url,
    start_simulator,
)
from bench.passthrough import body_for

WARMUP = 100
READY_TIMEOUT_S = 600.0  # start-up under valgrind: imports run several times slower than natively


@dataclass(frozen=True)
class Target:
    """A server to count: its name, the command that serves on `port`, and the PYTHONPATH it runs with."""

    name: str
    command: list[str]
    port: int
    health: str
    pythonpath: str | None = None
    lone: bool = False


def broker_target(name: str, config: dict[str, Any], port: int, *, pythonpath: Path | None = None,
                  lone: bool = False) -> Target:
    """`mergebroker serve` with `config` on `port`."""
    config = {**config, "server": {**config.get("server", {}), "port": port, "host": "127.0.0.1"}}
    path = Path(tempfile.mkdtemp(prefix="mb-instr-cfg-")) / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return Target(name, [sys.executable, "-m", "mergebroker.broker.cli", "serve", "--config", str(path)], port,
                  "/readyz", str(pythonpath) if pythonpath else None, lone)


def proxy_target(upstream: str, port: int) -> Target:
    """The minimal proxy on `port` (run from this checkout, as `bench.passthrough` runs it)."""
    return Target("proxy", [sys.executable, "-m", "bench.proxy_baseline", "--port", str(port), "--upstream",
                            upstream], port, "/healthz", str(Path(__file__).resolve().parent.parent))


def callgrind_total(out_prefix: Path) -> int:
    """The instructions counted in the dumps callgrind wrote under `out_prefix` (the explicit dump and the one
    it writes at exit, which holds what ran after instrumentation was switched off: nothing)."""
    total = 0
    for path in out_prefix.parent.glob(out_prefix.name + "*"):
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("totals:"):
                total += int(line.split()[1])
    return total


def _control(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], capture_output=True, check=True, timeout=120)


async def count(target: Target, requests: int, concurrency: int) -> dict[str, Any]:
    """Serve `target` under callgrind, send it `requests` chat requests after a warm-up, and count."""
    workdir = Path(tempfile.mkdtemp(prefix=f"mb-instr-{target.name}-"))
    out = workdir / "callgrind.out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if target.pythonpath:
        env["PYTHONPATH"] = target.pythonpath
    proc = subprocess.Popen(["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
                             *target.command], stdout=(workdir / "out.log").open("wb"), stderr=subprocess.STDOUT,
                            env=env)
    server = Process(proc, target.port, workdir / "out.log")
    try:
        await _wait_http(server.url + target.health, timeout_s=READY_TIMEOUT_S)
        send = chat_request(server.url, body_for(uuid.uuid4().hex[:8], lone=target.lone))
        await closed_loop(send, concurrency=concurrency, total=WARMUP)
        _control(proc.pid, "--instr=on")
        _control(proc.pid, "--zero")
        samples, wall = await closed_loop(send, concurrency=concurrency, total=requests)
        _control(proc.pid, "--instr=off")
        _control(proc.pid, "--dump")
    finally:
        server.stop()
    ok = sum(1 for s in samples if s.status == 200)
    return {"target": target.name, "requests": len(samples), "ok": ok,
            "m_instructions_per_request": callgrind_total(out) / max(1, len(samples)) / 1e6, "wall_s": wall}


async def run(requests: int, concurrency: int, old_checkout: Path | None, lone: bool) -> dict[str, Any]:
    """Count each target in turn, against one simulator (run natively, latency 0)."""
    started = time.perf_counter()
    rows = []
    async with processes_together(start_simulator("--latency-base-ms", "0")) as (sim,):
        upstream = sim_base_url(sim)
        targets = [proxy_target(upstream, free_port()),
                   broker_target("broker", passthrough_config(upstream), free_port())]
        if old_checkout is not None:
            targets.append(broker_target("broker_old", passthrough_config(upstream), free_port(),
                                         pythonpath=old_checkout_path(old_checkout)))
        if lone:
            targets.append(broker_target("broker_defaults", {"providers": [{"name": "sim", "base_url": upstream}]},
                                         free_port(), lone=True))
        for target in targets:  # one at a time: callgrind's count is exact, and two at once would only be slower
            rows.append(await count(target, requests, concurrency))
    proxy = rows[0]["m_instructions_per_request"]
    for row in rows:
        row["vs_proxy"] = row["m_instructions_per_request"] / proxy if proxy else float("nan")
    by_name = {r["target"]: r["m_instructions_per_request"] for r in rows}
    ratios = {}
    if "broker_old" in by_name:
        ratios["broker_vs_old"] = by_name["broker"] / by_name["broker_old"]
    if "broker_defaults" in by_name:
        ratios["lone_vs_passthrough"] = by_name["broker_defaults"] / by_name["broker"]
    return {"requests": requests, "concurrency": concurrency, "rows": rows, "ratios": ratios,
            "meta": run_meta(started)}


def report(result: dict[str, Any]) -> str:
    """The table of counts, and the ratios."""
    lines = [f"Instructions per request under callgrind ({result['requests']} requests at concurrency "
             f"{result['concurrency']}; the server process only)",
             format_table(result["rows"], ["target", "ok", "m_instructions_per_request", "vs_proxy"])]
    lines += [f"{name}: {value:.3f}x" for name, value in result["ratios"].items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Count, print the table and write the JSON."""
    parser = argparse.ArgumentParser(prog="python -m bench.instructions", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=400, help="measured requests per target")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--old-checkout", type=Path, help="also count that checkout's broker, side by side")
    parser.add_argument("--lone", action="store_true", help="also count the broker at its defaults on requests "
                        "that cannot merge")
    parser.add_argument("--out", help="JSON output file")
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        parser.error("needs valgrind (its callgrind tool and callgrind_control) on the PATH")
    result = asyncio.run(run(args.requests, args.concurrency, args.old_checkout, args.lone))
    publish(result, report(result), args.out or str(results_path("instructions.json")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
