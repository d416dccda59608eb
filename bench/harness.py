"""Benchmark harness: run the simulator and the broker as real processes, drive load, measure.

Processes are separate so the broker's CPU time can be read from /proc and is not mixed with the load
generator's. Load is either closed-loop (fixed concurrency) or open-loop (Poisson arrivals at a rate).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

import aiohttp
import yaml

CLK_TCK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


@dataclass
class Process:
    """A child process serving HTTP on a loopback port."""

    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cpu(self) -> float:
        return cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def _wait_http(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with session.get(url) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.1)  # polling a child process's readiness: nothing to await on
    raise RuntimeError(f"{url} did not become ready")


def _spawn(args: list[str], name: str) -> tuple[subprocess.Popen[bytes], Path]:
    log_path = Path(tempfile.mkdtemp(prefix=f"mb-bench-{name}-")) / "out.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.Popen(args, stdout=log_path.open("wb"), stderr=subprocess.STDOUT, env=env)
    return proc, log_path


async def start_simulator(*options: str) -> Process:
    """`mergebroker simulate` on a free port, e.g. start_simulator("--latency-base-ms", "300")."""
    port = free_port()
    proc, log = _spawn([sys.executable, "-m", "broker.cli", "simulate", "--port", str(port), *options], "sim")
    p = Process(proc, port, log)
    await _wait_http(p.url + "/v1/models")
    return p


async def start_broker(config: dict[str, Any]) -> Process:
    """`mergebroker serve` with `config` (a settings dict) on a free port; waits for /readyz."""
    port = free_port()
    config = {**config, "server": {**config.get("server", {}), "port": port, "host": "127.0.0.1"},
              "logging": {"level": "warning"}}
    path = Path(tempfile.mkdtemp(prefix="mb-bench-cfg-")) / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    proc, log = _spawn([sys.executable, "-m", "broker.cli", "serve", "--config", str(path)], "broker")
    p = Process(proc, port, log)
    await _wait_http(p.url + "/readyz")
    return p


@dataclass
class Sample:
    latency_s: float
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: dict[str, Any] | None = None
    tag: str = ""


RequestFn = Callable[[aiohttp.ClientSession, int], Awaitable[Sample]]


def chat_request(url: str, body_for: Callable[[int], tuple[dict[str, Any], dict[str, str], str]],
                 keep_body: bool = False) -> RequestFn:
    """A request function posting `body_for(i)` = (json body, headers, tag) to `url`/v1/chat/completions."""

    async def send(session: aiohttp.ClientSession, i: int) -> Sample:
        body, headers, tag = body_for(i)
        started = time.perf_counter()
        async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
            data = await resp.json(content_type=None)
            elapsed = time.perf_counter() - started
            keep = {k: v for k, v in resp.headers.items() if k.lower().startswith("x-broker")}
            return Sample(elapsed, resp.status, keep, data if keep_body else None, tag)

    return send


async def closed_loop(send: RequestFn, *, concurrency: int, total: int) -> tuple[list[Sample], float]:
    """`concurrency` workers sending `total` requests back to back; returns samples and wall seconds."""
    counter = iter(range(total))
    samples: list[Sample] = []
    connector = aiohttp.TCPConnector(limit=concurrency * 2)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def worker() -> None:
            for i in counter:
                samples.append(await send(session, i))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return samples, time.perf_counter() - started


async def open_loop(send: RequestFn, *, rate: float, total: int, seed: int = 7) -> tuple[list[Sample], float]:
    """Poisson arrivals at `rate` req/s; every request runs to completion."""
    rng = random.Random(seed)
    samples: list[Sample] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(i: int) -> None:
            samples.append(await send(session, i))

        tasks = []
        started = time.perf_counter()
        next_at = started
        for i in range(total):
            next_at += rng.expovariate(rate)
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # the arrival process itself
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
        return samples, time.perf_counter() - started


async def get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as session:
        async with session.get(url) as resp:
            return await resp.json(content_type=None)


async def post_json(url: str, body: Any) -> Any:
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json=body) as resp:
            return await resp.json(content_type=None)


def summarize(samples: list[Sample], wall_s: float) -> dict[str, Any]:
    lat = [s.latency_s * 1000 for s in samples]
    ok = sum(1 for s in samples if s.status == 200)
    return {"requests": len(samples), "ok": ok, "rps": len(samples) / wall_s if wall_s else 0.0,
            "p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99)}


def write_json(path: str | Path, data: Any) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2))


@contextlib.asynccontextmanager
async def processes(*starters: Awaitable[Process]) -> AsyncIterator[list[Process]]:
    started: list[Process] = []
    try:
        for starter in starters:
            started.append(await starter)
        yield started
    finally:
        for p in started:
            p.stop()
