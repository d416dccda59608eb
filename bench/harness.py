"""Benchmark harness: run the simulator and the broker as real processes, drive load, measure.

Processes are separate so the broker's CPU time can be read from /proc and is not mixed with the load
generator's. Load is either closed-loop (fixed concurrency) or open-loop (Poisson arrivals at a rate).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import itertools
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


def median_of_measured(values: Sequence[float]) -> float:
    """The median of `values` without the NaNs of runs that measured nothing (NaN when none did)."""
    clean = [v for v in values if v == v]
    return statistics.median(clean) if clean else float("nan")


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


def _spawn(args: list[str], name: str, *, pythonpath: Path | None = None) -> tuple[subprocess.Popen[bytes], Path]:
    log_path = Path(tempfile.mkdtemp(prefix=f"mb-bench-{name}-")) / "out.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    proc = subprocess.Popen(args, stdout=log_path.open("wb"), stderr=subprocess.STDOUT, env=env)
    return proc, log_path


async def start_simulator(*options: str) -> Process:
    """`mergebroker simulate` on a free port, e.g. start_simulator("--latency-base-ms", "300")."""
    port = free_port()
    proc, log = _spawn([sys.executable, "-m", "mergebroker.broker.cli", "simulate", "--port", str(port), *options], "sim")
    p = Process(proc, port, log)
    await _wait_http(p.url + "/v1/models")
    return p


def old_checkout_path(checkout: Path) -> Path:
    """A PYTHONPATH directory that imports `mergebroker` from another checkout (e.g. a `git worktree` of an
    older commit), its folders mapped as setup.py maps them: that version's broker, beside this one."""
    root = Path(tempfile.mkdtemp(prefix="mb-old-"))
    package = root / "mergebroker"
    package.mkdir()
    for item in (checkout / "core").iterdir():
        (package / item.name).symlink_to(item.resolve())
    for layer in ("merge", "breaker", "providers", "broker"):
        (package / layer).symlink_to((checkout / layer).resolve())
    return root


async def start_broker(config: dict[str, Any], *, pythonpath: Path | None = None) -> Process:
    """`mergebroker serve` with `config` (a settings dict) on a free port; waits for /readyz. Logging stays at
    the config's (default: info, as users run it); `pythonpath` runs another checkout's broker."""
    port = free_port()
    config = {**config, "server": {**config.get("server", {}), "port": port, "host": "127.0.0.1"}}
    path = Path(tempfile.mkdtemp(prefix="mb-bench-cfg-")) / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    proc, log = _spawn([sys.executable, "-m", "mergebroker.broker.cli", "serve", "--config", str(path)], "broker",
                       pythonpath=pythonpath)
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
                 keep_body: bool = False, *, tolerant: bool = False, timeout_s: float = 60.0) -> RequestFn:
    """A request function posting `body_for(i)` = (json body, headers, tag) to `url`/v1/chat/completions.

    `tolerant`: it never raises; every request yields exactly one `TimedSample` (status 0 for no answer within
    `timeout_s`), for runs that count failures rather than stop at the first.
    """

    async def send(session: aiohttp.ClientSession, i: int) -> Sample:
        body, headers, tag = body_for(i)
        started = time.perf_counter()
        async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
            data = await resp.json(content_type=None)
            elapsed = time.perf_counter() - started
            keep = {k: v for k, v in resp.headers.items() if k.lower().startswith("x-broker")}
            return Sample(elapsed, resp.status, keep, data if keep_body else None, tag)

    async def send_tolerant(session: aiohttp.ClientSession, i: int) -> Sample:
        body, headers, tag = body_for(i)
        started = time.perf_counter()
        try:
            async with session.post(url + "/v1/chat/completions", json=body, headers=headers,
                                    timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                data = await resp.json(content_type=None)
                status = resp.status
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            return TimedSample(time.perf_counter() - started, 0, tag=tag, sent_at=started,
                               error_code=f"transport:{type(exc).__name__}")
        elapsed = time.perf_counter() - started
        return TimedSample(elapsed, status, tag=tag, sent_at=started, error_code=_error_code(status, data))

    return send_tolerant if tolerant else send


async def closed_loop(send: RequestFn, *, concurrency: int, total: int | None = None,
                      stop: asyncio.Event | None = None, first_index: int = 0) -> tuple[list[Sample], float]:
    """`concurrency` workers sending back to back: `total` requests, or until `stop` is set (requests in
    flight then finish); returns samples and wall seconds."""
    if (total is None) == (stop is None):
        raise ValueError("closed_loop runs either `total` requests or until `stop`")
    indices = iter(range(first_index, first_index + total)) if total is not None else itertools.count(first_index)
    samples: list[Sample] = []
    connector = aiohttp.TCPConnector(limit=concurrency * 2)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def worker() -> None:
            for i in indices:
                if stop is not None and stop.is_set():
                    return
                samples.append(await send(session, i))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return samples, time.perf_counter() - started


async def open_loop(send: RequestFn, *, rate: float, total: int | None = None, duration_s: float | None = None,
                    seed: int = 7) -> tuple[list[Sample], float]:
    """Poisson arrivals at `rate` req/s: `total` requests, or as many as arrive in `duration_s`; every request
    runs to completion. Returns the samples (one per request sent) and the wall seconds until the last ended."""
    if (total is None) == (duration_s is None):
        raise ValueError("open_loop runs either `total` requests or for `duration_s`")
    rng = random.Random(seed)
    samples: list[Sample] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(i: int) -> None:
            samples.append(await send(session, i))

        tasks: list[asyncio.Task[None]] = []
        started = time.perf_counter()
        next_at = started
        while total is None or len(tasks) < total:
            next_at += rng.expovariate(rate)
            if duration_s is not None and next_at - started >= duration_s:
                break
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # the arrival process itself
            tasks.append(asyncio.create_task(one(len(tasks))))
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


# Additions for the passthrough, tiers and chaos benchmarks. Existing functions above keep their signatures.


def sim_base_url(sim: Process) -> str:
    """The simulator's OpenAI base URL (what a provider's `base_url` and the proxy's --upstream take)."""
    return sim.url + "/v1"


def passthrough_config(upstream_base: str, **provider: Any) -> dict[str, Any]:
    """A broker config with one provider and neither merging nor caching: every request goes straight through.

    `provider` adds provider fields (e.g. `rpm=600`, `breaker={...}`).
    """
    return {"providers": [{"name": "sim", "base_url": upstream_base, **provider}],
            "merge": {"enabled": False}, "cache": {"enabled": False}}


async def start_proxy(upstream_base: str) -> Process:
    """`bench.proxy_baseline` (the minimal reverse proxy) on a free port in front of `upstream_base`."""
    port = free_port()
    proc, log = _spawn([sys.executable, "-m", "bench.proxy_baseline", "--port", str(port),
                        "--upstream", upstream_base], "proxy")
    p = Process(proc, port, log)
    await _wait_http(p.url + "/healthz")
    return p


@contextlib.asynccontextmanager
async def processes_together(*starters: Awaitable[Process]) -> AsyncIterator[list[Process]]:
    """Like `processes`, but starts them concurrently (start-up is mostly imports); stops all on exit."""
    results = await asyncio.gather(*starters, return_exceptions=True)
    started = [r for r in results if isinstance(r, Process)]
    try:
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            raise failed
        yield started
    finally:
        for p in started:
            p.stop()


async def set_faults(sim: Process, **fields: Any) -> dict[str, Any]:
    """Change the simulator's fault/latency fields now (POST /control/faults); returns all of them."""
    return await post_json(sim.url + "/control/faults", fields)


def run_seconds(pid: int) -> float:
    """CPU seconds the live threads of a process have run, in nanoseconds precision (/proc/PID/task/*/schedstat).

    Unlike `cpu_seconds`, which counts 10 ms ticks (statistical at low load: at 10 requests/s a
    30 s run is only ~100 ticks), this is the scheduler's exact run time. Falls back to
    `cpu_seconds` where schedstat is missing.
    """
    total = 0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError):  # a thread that just exited
                total += int((task / "schedstat").read_text().split()[0])
    except (FileNotFoundError, ValueError, IndexError):
        return cpu_seconds(pid)
    return total / 1e9


@dataclass
class CpuWindow:
    """CPU seconds a process spends from construction on; `ms_per(n)` spreads them over n requests."""

    process: Process
    started: float = field(init=False)

    def __post_init__(self) -> None:
        self.started = run_seconds(self.process.proc.pid)

    def seconds(self) -> float:
        """CPU seconds since the window opened (scheduler run time of its threads)."""
        return run_seconds(self.process.proc.pid) - self.started

    def ms_per(self, count: int) -> float:
        """CPU milliseconds per request over `count` requests (NaN for none)."""
        return self.seconds() * 1000 / count if count else float("nan")


def latency_summary(latencies_ms: Sequence[float]) -> dict[str, float]:
    """p50, p90, p99, max and mean of latencies in ms (NaN when empty)."""
    if not latencies_ms:
        return {"p50_ms": float("nan"), "p90_ms": float("nan"), "p99_ms": float("nan"),
                "max_ms": float("nan"), "mean_ms": float("nan")}
    return {"p50_ms": percentile(latencies_ms, 50), "p90_ms": percentile(latencies_ms, 90),
            "p99_ms": percentile(latencies_ms, 99), "max_ms": max(latencies_ms),
            "mean_ms": sum(latencies_ms) / len(latencies_ms)}


@dataclass
class TimedSample(Sample):
    """A Sample that also records when it was sent (perf_counter seconds) and the error code of a failure.

    `status` 0 means no HTTP answer arrived (connection error or client timeout); `error_code` is then
    "transport:<exception>". For an HTTP error it is the envelope's `error.code`; for a 200 whose body has
    no choices it is "bad_body".
    """

    sent_at: float = 0.0
    error_code: str | None = None

    @property
    def done_at(self) -> float:
        """When the answer (or the failure) arrived, perf_counter seconds."""
        return self.sent_at + self.latency_s


def _error_code(status: int, data: Any) -> str | None:
    if status == 200:
        ok = isinstance(data, dict) and bool(data.get("choices"))
        return None if ok else "bad_body"
    error = data.get("error") if isinstance(data, dict) else None
    return str(error.get("code") or error.get("type")) if isinstance(error, dict) else f"http_{status}"


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """Rows as a fixed-width text table; floats with 2 decimals (3 significant digits below 1)."""
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return "nan" if value != value else (f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}")
        return "-" if value is None else str(value)

    table = [list(columns)] + [[cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(columns))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def results_path(name: str) -> Path:
    """Where a benchmark writes its JSON by default: bench/results/NAME (git-ignored)."""
    return Path(__file__).resolve().parent / "results" / name


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_results(path: str | Path, data: Any) -> None:
    """`write_json`, with NaN written as null so that any JSON reader accepts the file."""
    write_json(path, _json_safe(data))


def publish(result: dict[str, Any], table: str, out: str | Path) -> None:
    """A benchmark's ending: print its tables, write its JSON to `out`, say where."""
    print(table)
    write_results(out, result)
    print(f"\nwrote {out}")


async def warm_up(url: str, body_for: Callable[[int], tuple[dict[str, Any], dict[str, str], str]],
                  requests: int = 8) -> None:
    """Send `requests` chat requests at once and ignore the answers, so first-call costs stay out of a measurement."""
    send = chat_request(url, body_for, tolerant=True)
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(send(session, i) for i in range(requests)))


def off_loop_seconds(pid: int) -> float:
    """CPU seconds run by a process's threads other than its main one (schedstat, like `run_seconds`).

    In the broker the main thread runs the event loop; the others are the embedding model's worker
    thread (and, at start-up only, the thread that loads the tokenizer), so over a measurement window
    this is the CPU the similarity model costs.
    """
    main = Path(f"/proc/{pid}/task/{pid}/schedstat")
    try:
        own = int(main.read_text().split()[0]) / 1e9
    except (FileNotFoundError, ValueError, IndexError):
        return 0.0
    return run_seconds(pid) - own


CODE_DIRS = ("broker", "merge", "breaker", "providers")


def code_version() -> str | None:
    """The commit the measured code comes from, marked when the broker code has uncommitted changes.

    Read from git in the repository that holds this file (None outside a git checkout).
    """
    repo = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout

    try:
        commit = git("rev-parse", "--short", "HEAD").strip()
        dirty = git("status", "--porcelain", "--", *CODE_DIRS).strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"{commit} with uncommitted changes to the broker code" if dirty else commit


def cpu_probe_ms() -> float:
    """Milliseconds a fixed pure-Python loop takes (best of 3): how fast the host runs right now.

    A shared virtual machine can slow down without showing it in its load average; taken at the start
    and the end of a benchmark, this says whether the run's absolute figures were measured on a slow host.
    """
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        total = 0
        for i in range(300_000):
            total += i * i % 7
        best = min(best, time.perf_counter() - started)
    return round(1000 * best, 1)


def run_meta(started: float, probe_at_start: float | None = None) -> dict[str, Any]:
    """When, where and on which code a benchmark ran (UTC time, CPUs, load average, seconds since `started`),
    with `cpu_probe_ms` at the start (`probe_at_start`, taken by the caller) and now."""
    return {"generated_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "cpus": os.cpu_count(), "load_average_at_end": os.getloadavg()[0],
            "duration_s": round(time.perf_counter() - started, 1), "code": code_version(),
            "cpu_probe_ms_start": probe_at_start, "cpu_probe_ms_end": cpu_probe_ms()}


async def new_and_old(config: dict[str, Any], old_checkout: Path | None, warm: Callable[[Process], Awaitable[Any]],
                      measure: Callable[[Process, int], Awaitable[dict[str, Any]]],
                      rounds: int) -> dict[str, list[dict[str, Any]]]:
    """This checkout's broker ("broker") and, given `old_checkout`, that one's ("broker_old"), both with `config`:
    each warmed once, then measured `rounds` times in interleaved rounds whose order alternates (`measure(target,
    round)` gives a round's figures). Returns each target's rounds, in order."""
    targets = {"broker": await start_broker(config)}
    try:
        if old_checkout is not None:
            targets["broker_old"] = await start_broker(config, pythonpath=old_checkout_path(old_checkout))
        for target in targets.values():  # warm: connections open, code paths run once
            await warm(target)
        measured: dict[str, list[dict[str, Any]]] = {name: [] for name in targets}
        order = list(targets)
        for n in range(rounds):
            for name in order if n % 2 == 0 else order[::-1]:
                measured[name].append(await measure(targets[name], n))
    finally:
        for target in targets.values():
            target.stop()
    return measured


def cpu_vs_old(measured: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    """{"cpu_vs_old": the median over rounds of new / old "cpu_ms"} where both brokers ran (`new_and_old`), else
    {}."""
    if "broker_old" not in measured:
        return {}
    return {"cpu_vs_old": statistics.median(a["cpu_ms"] / b["cpu_ms"] for a, b in zip(measured["broker"],
                                                                                      measured["broker_old"]))}
