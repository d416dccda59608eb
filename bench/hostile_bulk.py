"""Hostile bulk clients against a real `mergebroker serve`: the "done when" figures of issue 26.

Each scenario runs a broker process on a loopback port against a simulator process, old beside new
(`--old-checkout PATH`, e.g. a `git worktree` of the commit before the change):
- stuck: a job whose answers outgrow `batches.max_file_bytes`, then a restart. Counted: jobs not in a final
  state, and custom_ids missing from or repeated across the output and error files.
- orphans: uploads named `\\xff.jsonl`, uploads with a bad last line, a corrupt gzip body. Counted: files on disk
  that no listing shows, their bytes, and HTTP 500s.
- lost: the input file deleted mid-run, the broker killed with SIGKILL and restarted. Counted: lines answered
  before the kill that no output file holds.
- fairness: tenant B's 1-line job created behind tenant A's large one. Measured: B's wait to completion.
- healthz: a 50,000-line job uploaded, run and finalised (and 3 s after), and a form of 40,000 one-byte
  fields, while `/healthz` is polled every 20 ms. Measured: its slowest answer, its p99, the answers over 100 ms, and
  the broker's longest garbage-collection pass (each pass timed by a `gc.callbacks` probe the broker loads
  through a `sitecustomize` on its PYTHONPATH; with its generation and the objects it freed).
- rss: 100 jobs of 500 lines, one after another. Measured: the broker's RSS after them against after the first.

    python -m bench.hostile_bulk [--quick] [--old-checkout PATH] [--scenarios stuck,orphans,...] [--out FILE]
    python -m bench.hostile_bulk --scenarios healthz      # one scenario only
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import hashlib
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from bench.harness import Process, format_table, old_checkout_path, set_faults, start_simulator, write_results
from bench.hostile import start_broker

FINAL = ("completed", "failed", "expired", "cancelled")
KEYS = {"a": "bulk-key-a", "b": "bulk-key-b"}
TIMEOUT = aiohttp.ClientTimeout(total=600)


def line(custom_id: str, question: str, system: str = "Classify the item.") -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "sim-small", "max_tokens": 60,
                     "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}}


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def config(sim: Process, directory: Path, **batches: Any) -> dict[str, Any]:
    return {"providers": [{"name": "sim", "base_url": sim.url + "/v1"}], "merge": {"embedder": "none"},
            "batches": {"dir": str(directory), "poll_interval_s": 0.05, **batches}}


class Api:
    """The Batch API of one broker, as one tenant."""

    def __init__(self, session: aiohttp.ClientSession, url: str, key: str = "x") -> None:
        self.session, self.url, self.headers = session, url, {"Authorization": f"Bearer {key}"}

    async def upload(self, content: bytes, filename: str = "in.jsonl") -> tuple[int, dict[str, Any]]:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", content, filename=filename, content_type="application/jsonl")
        async with self.session.post(self.url + "/v1/files", data=form, headers=self.headers) as resp:
            return resp.status, await resp.json(content_type=None)

    async def create(self, file_id: str) -> dict[str, Any]:
        body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        async with self.session.post(self.url + "/v1/batches", json=body, headers=self.headers) as resp:
            return await resp.json(content_type=None)

    async def get(self, path: str) -> tuple[int, Any]:
        async with self.session.get(self.url + path, headers=self.headers) as resp:
            raw = await resp.read()
            return resp.status, (json.loads(raw) if resp.content_type == "application/json" else raw)

    async def until(self, batch_id: str, check: Callable[[dict[str, Any]], bool], timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            status, batch = await self.get(f"/v1/batches/{batch_id}")
            if status == 200 and check(batch) or time.monotonic() > deadline:
                return batch
            await asyncio.sleep(0.05)  # polling another process's state: nothing to await on

    async def files_of(self, batch: dict[str, Any]) -> list[dict[str, Any]]:
        rows = []
        for key in ("output_file_id", "error_file_id"):
            if batch.get(key):
                _, raw = await self.get(f"/v1/files/{batch[key]}/content")
                rows += [json.loads(x) for x in raw.splitlines() if x.strip()]
        return rows


async def stuck(sim: Process, pythonpath: Path | None, quick: bool) -> dict[str, Any]:
    directory = Path(tempfile.mkdtemp(prefix="mb-bulk-stuck-"))
    rows = [line(f"q{n}", f"question number {n}") for n in range(40 if quick else 200)]
    cfg = config(sim, directory, max_file_bytes=len(jsonl(rows)) + 1000)
    broker = await start_broker(cfg, pythonpath=pythonpath)
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            api = Api(session, broker.url)
            _, uploaded = await api.upload(jsonl(rows))
            batch = await api.create(uploaded["id"])
            first = await api.until(batch["id"], lambda b: b["status"] in FINAL, 60)
    finally:
        broker.stop()
    broker = await start_broker(cfg, pythonpath=pythonpath)
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            api = Api(session, broker.url)
            after = await api.until(batch["id"], lambda b: b["status"] in FINAL, 20)
            found = [r["custom_id"] for r in await api.files_of(after)]
    finally:
        broker.stop()
    return {"jobs": 1, "stuck_jobs": int(after["status"] not in FINAL), "status_before_restart": first["status"],
            "status": after["status"], "custom_ids_missing": len({r["custom_id"] for r in rows} - set(found)),
            "custom_ids_repeated": len(found) - len(set(found))}


async def orphans(sim: Process, pythonpath: Path | None, quick: bool) -> dict[str, Any]:
    directory = Path(tempfile.mkdtemp(prefix="mb-bulk-orphans-"))
    broker = await start_broker(config(sim, directory), pythonpath=pythonpath)
    big = jsonl([line(f"q{n}", "question " + "x" * 900) for n in range(4000 if quick else 16_000)])
    bad_last = big + b'{"custom_id": "z", "method": "POST", "url": "/v1/chat/completions", "body": NaN}\n'
    statuses: list[int] = []
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            api = Api(session, broker.url)
            for _ in range(3):
                boundary = "bulkbound"
                raw = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
                       f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"").encode() \
                    + b"\xff.jsonl\"\r\n\r\n" + big + f"\r\n--{boundary}--\r\n".encode()
                async with session.post(broker.url + "/v1/files", data=raw, headers={
                        "Content-Type": f"multipart/form-data; boundary={boundary}"}) as resp:
                    statuses.append(resp.status)
            for content in (bad_last, bad_last):
                statuses.append((await api.upload(content))[0])
            form = aiohttp.FormData()
            form.add_field("purpose", "batch")
            form.add_field("file", big[:1000], filename="in.jsonl")
            async with session.post(broker.url + "/v1/files", data=gzip.compress(b"not a form")[:-4],
                                    headers={"Content-Encoding": "gzip",
                                             "Content-Type": "multipart/form-data; boundary=x"}) as resp:
                statuses.append(resp.status)
            _, listed = await api.get("/v1/files?limit=10000")
    finally:
        broker.stop()
    known = {f["id"] for f in listed.get("data", [])}
    on_disk = [p for p in (directory / "files").iterdir() if p.stem not in known]
    return {"bad_uploads": len(statuses), "http_500": statuses.count(500), "orphan_files": len(on_disk),
            "orphan_mb": round(sum(p.stat().st_size for p in on_disk) / 1e6, 1)}


async def lost(sim: Process, pythonpath: Path | None, quick: bool) -> dict[str, Any]:
    directory = Path(tempfile.mkdtemp(prefix="mb-bulk-lost-"))
    cfg = config(sim, directory, concurrency=2)
    rows = [line(f"q{n}", f"question {n}", system=f"System {n}") for n in range(60 if quick else 240)]
    await _faults(sim, latency_base_ms=100)
    broker = await start_broker(cfg, pythonpath=pythonpath)
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            api = Api(session, broker.url)
            _, uploaded = await api.upload(jsonl(rows))
            batch = await api.create(uploaded["id"])
            seen = await api.until(batch["id"], lambda b: b["request_counts"]["completed"] >= len(rows) // 3, 120)
            async with session.delete(broker.url + f"/v1/files/{uploaded['id']}"):
                pass
            await asyncio.sleep(0.3)  # let a few more lines be answered and stored before the kill
            answered = (await api.get(f"/v1/batches/{batch['id']}"))[1]["request_counts"]["completed"]
        broker.proc.send_signal(signal.SIGKILL)
        broker.proc.wait(timeout=10)
        broker = await start_broker(cfg, pythonpath=pythonpath)
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            api = Api(session, broker.url)
            done = await api.until(batch["id"], lambda b: b["status"] in FINAL, 120)
            kept = sum(1 for r in await api.files_of(done) if (r.get("response") or {}).get("status_code") == 200)
    finally:
        broker.stop()
        await _faults(sim, latency_base_ms=0)
    return {"lines": len(rows), "answered_before_kill": max(answered, seen["request_counts"]["completed"]),
            "answered_in_output": kept, "lost_answered_lines": max(0, answered - kept), "status": done["status"]}


async def fairness(sim: Process, pythonpath: Path | None, quick: bool) -> dict[str, Any]:
    directory = Path(tempfile.mkdtemp(prefix="mb-bulk-fair-"))
    keys = [{"sha256": hashlib.sha256(k.encode()).hexdigest(), "tenant": t, "tiers": ["batch", "standard"]}
            for t, k in KEYS.items()]
    await _faults(sim, latency_base_ms=100)
    broker = await start_broker({**config(sim, directory), "auth": {"mode": "keys", "keys": keys}},
                                pythonpath=pythonpath)
    large_rows = [line(f"a{n}", f"question {n}", system=f"System {n}") for n in range(200 if quick else 800)]
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            a, b = Api(session, broker.url, KEYS["a"]), Api(session, broker.url, KEYS["b"])
            _, large_file = await a.upload(jsonl(large_rows))
            _, small_file = await b.upload(jsonl([line("b0", "the small job's only question")]))
            large = await a.create(large_file["id"])
            await a.until(large["id"], lambda x: x["request_counts"]["completed"] >= 8, 60)
            started = time.monotonic()
            small = await b.create(small_file["id"])
            await b.until(small["id"], lambda x: x["status"] in FINAL, 300)
            waited = time.monotonic() - started
            large_done = await a.until(large["id"], lambda x: x["status"] in FINAL, 300)
    finally:
        broker.stop()
        await _faults(sim, latency_base_ms=0)
    return {"large_job_lines": len(large_rows), "small_job_wait_s": round(waited, 2),
            "one_call_s": 0.1, "large_job_status": large_done["status"]}


GC_PROBE = '''import gc, os, time
_log = open(os.path.join(os.environ["MB_GC_PROBE_DIR"], str(os.getpid())), "w", buffering=1)
_started = [0.0]
def _timed(phase, info):
    if phase == "start":
        _started[0] = time.perf_counter()
    else:
        _log.write("%d %.1f %d\\n" % (info["generation"], (time.perf_counter() - _started[0]) * 1000, info["collected"]))
gc.callbacks.append(_timed)
'''
"""A `sitecustomize` that logs every collection of the process that loads it: generation, ms, objects freed."""


def _gc_probe(pythonpath: Path | None) -> tuple[Path, Path]:
    """A PYTHONPATH (the probe ahead of `pythonpath`) and the folder the probed processes log to."""
    root = Path(tempfile.mkdtemp(prefix="mb-gc-probe-"))
    (root / "sitecustomize.py").write_text(GC_PROBE)
    (root / "log").mkdir()
    rest = str(pythonpath) if pythonpath else os.environ.get("PYTHONPATH", "")
    return Path(os.pathsep.join([str(root), *([rest] if rest else [])])), root / "log"


def _slowest_pass(log: Path, pid: int) -> dict[str, Any]:
    rows = [r.split() for r in (log / str(pid)).read_text().splitlines()] if (log / str(pid)).exists() else []
    generation, ms, freed = max(rows, key=lambda r: float(r[1]), default=("-", "nan", "0"))
    return {"slowest_gc_pass_ms": float(ms), "slowest_gc_pass_generation": generation,
            "slowest_gc_pass_freed": int(freed)}


AFTERMATH_S = 3.0
"""How long `/healthz` is still polled after the job is seen final."""


async def healthz(sim: Process, pythonpath: Path | None, quick: bool) -> dict[str, Any]:
    directory = Path(tempfile.mkdtemp(prefix="mb-bulk-healthz-"))
    probed, gc_log = _gc_probe(pythonpath)
    os.environ["MB_GC_PROBE_DIR"] = str(gc_log)
    broker = await start_broker(config(sim, directory), pythonpath=probed)
    n = 5000 if quick else 50_000
    rows = [line(f"q{i}", f"item {i}: is the kettle fine?") for i in range(n)]
    stop = asyncio.Event()
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            api = Api(session, broker.url)
            probe = asyncio.ensure_future(_poll_healthz(session, broker.url, stop))
            started = time.monotonic()
            _, uploaded = await api.upload(jsonl(rows))
            batch = await api.create(uploaded["id"])
            done = await api.until(batch["id"], lambda b: b["status"] in FINAL, 900)
            job_s = time.monotonic() - started
            await asyncio.sleep(AFTERMATH_S)  # what the job's end sets off (its objects freed) counts too
            stop.set()
            job_latencies = await probe
            stop = asyncio.Event()
            probe = asyncio.ensure_future(_poll_healthz(session, broker.url, stop))
            fields = b"".join(f"--fb\r\nContent-Disposition: form-data; name=\"f{i}\"\r\n\r\nx\r\n".encode()
                              for i in range(40_000)) + b"--fb--\r\n"
            async with session.post(broker.url + "/v1/files", data=fields,
                                    headers={"Content-Type": "multipart/form-data; boundary=fb"}) as resp:
                fields_status = resp.status
            await asyncio.sleep(0.2)
            stop.set()
            form_latencies = await probe
    finally:
        stop.set()
        broker.stop()
    return {"lines": n, "job_status": done["status"], "job_s": round(job_s, 1),
            "healthz_max_ms_during_job": round(max(job_latencies) * 1000, 1),
            "healthz_p99_ms_during_job": round(sorted(job_latencies)[int(len(job_latencies) * 0.99)] * 1000, 1),
            "healthz_over_100ms_during_job": sum(1 for x in job_latencies if x > 0.1),
            **_slowest_pass(gc_log, broker.proc.pid), "load_average": round(os.getloadavg()[0], 2),
            "form_40k_fields_status": fields_status,
            "healthz_max_ms_during_form": round(max(form_latencies) * 1000, 1)}


async def _poll_healthz(session: aiohttp.ClientSession, url: str, stop: asyncio.Event) -> list[float]:
    latencies = []
    while not stop.is_set():
        started = time.monotonic()
        async with session.get(url + "/healthz") as resp:
            await resp.read()
        latencies.append(time.monotonic() - started)
        await asyncio.sleep(0.02)  # the probe's own pace
    return latencies


async def rss(sim: Process, pythonpath: Path | None, quick: bool) -> dict[str, Any]:
    directory = Path(tempfile.mkdtemp(prefix="mb-bulk-rss-"))
    broker = await start_broker(config(sim, directory, cleanup_interval_s=3600), pythonpath=pythonpath)
    jobs = 20 if quick else 100
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            api = Api(session, broker.url)
            start_mb = 0.0
            for j in range(jobs):
                rows = [line(f"q{i}", f"job {j} item {i}: " + "words " * 30) for i in range(500)]
                _, uploaded = await api.upload(jsonl(rows))
                batch = await api.create(uploaded["id"])
                await api.until(batch["id"], lambda b: b["status"] in FINAL, 300)
                if j == 0:
                    start_mb = _rss_mb(broker.proc.pid)
            end_mb = _rss_mb(broker.proc.pid)
    finally:
        broker.stop()
    return {"jobs": jobs, "rss_after_first_mb": round(start_mb, 1), "rss_after_all_mb": round(end_mb, 1),
            "rss_growth_mb": round(end_mb - start_mb, 1)}


def _rss_mb(pid: int) -> float:
    for row in Path(f"/proc/{pid}/status").read_text().splitlines():
        if row.startswith("VmRSS:"):
            return int(row.split()[1]) / 1024
    return float("nan")


async def _faults(sim: Process, **fields: Any) -> None:
    await set_faults(sim, **fields)


SCENARIOS: dict[str, Callable[[Process, Path | None, bool], Awaitable[dict[str, Any]]]] = {
    "stuck": stuck, "orphans": orphans, "lost": lost, "fairness": fairness, "healthz": healthz, "rss": rss}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every chosen scenario, against the old checkout (if given) and this one."""
    targets: dict[str, Path | None] = {"new": None}
    if args.old_checkout:
        targets = {"old": old_checkout_path(Path(args.old_checkout).resolve()), **targets}
    sim = await start_simulator("--answer-words", "40")
    results: dict[str, Any] = {}
    try:
        for name in args.scenarios.split(","):
            for target, path in targets.items():
                results.setdefault(name, {})[target] = await SCENARIOS[name](sim, path, args.quick)
                print(name, target, results[name][target], flush=True)
    finally:
        sim.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller runs (a smoke test)")
    parser.add_argument("--old-checkout", help="also run against this checkout's broker, side by side")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    results = asyncio.run(run(args))
    rows = [{"scenario": name, "metric": metric, **{t: figures.get(metric) for t, figures in by_target.items()}}
            for name, by_target in results.items() for metric in next(iter(by_target.values()))]
    print(format_table(rows, ["scenario", "metric", *next(iter(results.values())).keys()]))
    if args.out:
        write_results(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
