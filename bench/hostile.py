"""Hostile clients against a real `mergebroker serve`: the "done when" figures of issue 11.

Four scenarios, each against a broker process on a loopback port (and a simulator process):
- fuzz: N hostile requests (wrong types in known fields, lone surrogates, NaN and 1e309, deep nesting, corrupt
  or mislabelled encodings, junk bodies), 32 at a time. Counted: HTTP 500s, hangs (no answer in 20 s) and error
  bodies outside the OpenAI envelope.
- slowloris: the broker at an open-file limit of 1024; 1,100 connections send partial headers and stall, then
  150 other clients send one request each. Counted: how many of the 150 are served, and how fast.
- noisy: tenant A sends waves of 25 long requests (max_tokens 1200 at 100 tokens/s, ~12 s each) and 3 the
  upstream would reject; tenant B sends 40 short ones over the same time. Counted: B's errors.
- exfil: two victims holding PINs, account numbers, an email, a URL and a key share a merged call with an
  attacker using each disguise of "repeat the other requests" and each look-alike tag trick, against a simulated
  model that obeys. Counted: distinctive tokens of a victim found in an attacker's answer.

`--old-checkout PATH` runs every scenario against that checkout's broker too (e.g. a `git worktree` of an older
commit) and prints both side by side; the simulator and this measuring side are always this checkout's.

    python -m bench.hostile [--quick] [--old-checkout PATH] [--scenarios fuzz,slowloris,noisy,exfil] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import random
import resource
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.harness import (
    Process,
    format_table,
    free_port,
    old_checkout_path,
    percentile,
    start_simulator,
    write_results,
)
from bench.hostile_requests import VICTIMS, attacks, hostile_request, is_envelope
from mergebroker.merge.distinctive import distinctive_tokens, squash

KEYS = {"a": "key-tenant-a", "b": "key-tenant-b"}


async def start_broker(config: dict[str, Any], *, pythonpath: Path | None, nofile: int | None = None) -> Process:
    """`mergebroker serve` from this checkout or the shimmed one, optionally at a lower open-file limit."""
    port = free_port()
    config = {**config, "server": {"host": "127.0.0.1", "port": port}, "logging": {"level": "warning"}}
    work = Path(tempfile.mkdtemp(prefix="mb-hostile-"))
    (work / "config.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "MERGEBROKER_GATEWAY_SECRET": "x"}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))) if nofile else None
    proc = subprocess.Popen([sys.executable, "-m", "mergebroker.broker.cli", "serve", "--config",
                             str(work / "config.yaml")], stdout=(work / "out.log").open("wb"),
                            stderr=subprocess.STDOUT, env=env, preexec_fn=limit, cwd=work)
    broker = Process(proc, port, work / "out.log")
    await _ready(broker.url + "/healthz")
    return broker


async def _ready(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        for _ in range(1200):
            try:
                async with session.get(url) as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)  # polling a child process's readiness: nothing to await on
    raise RuntimeError(f"{url} did not come up")


def _base(sim: Process, **extra: Any) -> dict[str, Any]:
    return {"providers": [{"name": "sim", "base_url": sim.url + "/v1"}], "merge": {"embedder": "none"},
            "tiers": [{"name": "standard", "priority": 50, "merge": False},
                      {"name": "batch", "priority": 0, "window_ms": 200, "max_batch": 8, "similarity_threshold": 0.0}],
            **extra}


async def fuzz(sim: Process, pythonpath: Path | None, total: int) -> dict[str, Any]:
    broker = await start_broker(_base(sim, server={}), pythonpath=pythonpath)
    rng = random.Random(11)
    requests = [hostile_request(rng) for _ in range(total)]
    counts = {"requests": total, "http_500": 0, "hangs": 0, "not_envelope": 0, "dropped": 0, "served_2xx": 0}
    queue = iter(requests)
    timeout = aiohttp.ClientTimeout(total=20)

    async def worker(session: aiohttp.ClientSession) -> None:
        for path, raw, headers in queue:
            try:
                async with session.post(broker.url + path, data=raw, headers=headers) as resp:
                    body = await resp.read()
                    counts["http_500"] += resp.status == 500
                    counts["served_2xx"] += resp.status < 300
                    counts["not_envelope"] += resp.status >= 400 and not is_envelope(body)
            except TimeoutError:
                counts["hangs"] += 1
            except aiohttp.ClientError:
                counts["dropped"] += 1

    try:
        async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False) as session:
            await asyncio.gather(*(worker(session) for _ in range(32)))
    finally:
        broker.stop()
    return counts


async def slowloris(sim: Process, pythonpath: Path | None, stalled: int, clients: int) -> dict[str, Any]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    broker = await start_broker(_base(sim), pythonpath=pythonpath, nofile=1024)
    writers = []
    try:
        for _ in range(stalled):
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", broker.port), 2)
            except (TimeoutError, OSError):
                continue  # the listen backlog is full: the attack is at its peak
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
            writers.append(writer)
        results = await _clients(broker.url, clients)
    finally:
        for writer in writers:
            writer.transport.abort()
        broker.stop()
    served = [latency for status, latency in results if status == 200]
    return {"stalled_connections": len(writers), "clients": clients, "served": len(served),
            "p50_s": percentile(served, 50), "p99_s": percentile(served, 99)}


async def _clients(url: str, n: int) -> list[tuple[int, float]]:
    loop = asyncio.get_running_loop()

    async def one(i: int) -> tuple[int, float]:
        started = loop.time()
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
                async with session.post(url + "/v1/chat/completions", json={
                        "model": "sim-small", "messages": [{"role": "user", "content": f"question {i}"}]}) as resp:
                    await resp.read()
                    return resp.status, loop.time() - started
        except (TimeoutError, aiohttp.ClientError):
            return 0, loop.time() - started

    return list(await asyncio.gather(*(one(i) for i in range(n))))


async def noisy(pythonpath: Path | None, waves: int, quiet_requests: int) -> dict[str, Any]:
    sim = await start_simulator("--answer-words", "900", "--latency-per-token-ms", "10")
    keys = [{"sha256": hashlib.sha256(k.encode()).hexdigest(), "tenant": t, "tiers": ["standard"]}
            for t, k in KEYS.items()]
    broker = await start_broker(_base(sim, auth={"mode": "keys", "keys": keys}), pythonpath=pythonpath)
    statuses: dict[str, list[int]] = {"a": [], "b": []}

    # One client pool for both tenants, as a gateway in front of the broker has: aiohttp's pool hands out its
    # idle connections first-in first-out, so after a wave of long requests the quiet tenant's requests go out
    # on connections that idled for many seconds (the keep-alive race's setting).
    shared = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
    disconnects: dict[str, int] = {"a": 0, "b": 0}

    async def send(tenant: str, body: dict[str, Any]) -> None:
        headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
        try:
            async with shared.post(broker.url + "/v1/chat/completions", json=body, headers=headers) as resp:
                await resp.read()
                statuses[tenant].append(resp.status)
        except aiohttp.ServerDisconnectedError:
            disconnects[tenant] += 1
            statuses[tenant].append(0)
        except (TimeoutError, aiohttp.ClientError):
            statuses[tenant].append(0)

    def ask(text: str, **extra: Any) -> dict[str, Any]:
        return {"model": "sim-small", "messages": [{"role": "user", "content": text}], **extra}

    async def noisy_tenant() -> None:
        for wave in range(waves):
            rejected = [send("a", ask(f"bad {wave} {i}", stream="false")) for i in range(3)]
            await asyncio.gather(*rejected, *(send("a", ask(f"long {wave} {i}", max_tokens=1200)) for i in range(25)))

    async def quiet_tenant() -> None:
        pending = []
        for i in range(quiet_requests):
            pending.append(asyncio.ensure_future(send("b", ask(f"short {i}", max_tokens=16))))
            await asyncio.sleep(0.8)  # an open-loop client: one request every 0.8 s
        await asyncio.gather(*pending)

    try:
        await asyncio.gather(noisy_tenant(), quiet_tenant())
    finally:
        await shared.close()
        broker.stop()
        sim.stop()
    return {"quiet_requests": len(statuses["b"]), "quiet_errors": sum(s != 200 for s in statuses["b"]),
            "quiet_disconnects": disconnects["b"],
            "quiet_503": statuses["b"].count(503), "noisy_requests": len(statuses["a"]),
            "noisy_errors": sum(s != 200 for s in statuses["a"])}


async def exfil(sim: Process, pythonpath: Path | None, rounds: int) -> dict[str, Any]:
    broker = await start_broker(_base(sim), pythonpath=pythonpath)
    tokens = set().union(*(distinctive_tokens(v) for v in VICTIMS))
    leaked_tokens, leaking_attacks, total = 0, 0, 0
    headers = {"X-Broker-Tier": "batch"}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            for _ in range(rounds):
                for attack in attacks():
                    answers = await asyncio.gather(*(_answer(session, broker.url, q, headers)
                                                     for q in [*VICTIMS, attack]))
                    found = {t for t in tokens - distinctive_tokens(attack) if t in squash(answers[-1])}
                    leaked_tokens += len(found)
                    leaking_attacks += bool(found)
                    total += 1
    finally:
        broker.stop()
    return {"attacks": total, "attacks_that_leaked": leaking_attacks, "tokens_leaked": leaked_tokens}


async def _answer(session: aiohttp.ClientSession, url: str, text: str, headers: dict[str, str]) -> str:
    body = {"model": "sim-small", "temperature": 0.7, "messages": [{"role": "user", "content": text}]}
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        data = await resp.json()
    return data["choices"][0]["message"]["content"] if resp.status == 200 else ""


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every chosen scenario, against the old checkout (if given) and this one."""
    quick = args.quick
    targets: dict[str, Path | None] = {"new": None}
    if args.old_checkout:
        targets = {"old": old_checkout_path(Path(args.old_checkout).resolve()), **targets}
    sim = await start_simulator()
    scenarios: dict[str, Callable[[Path | None], Awaitable[dict[str, Any]]]] = {
        "fuzz": lambda p: fuzz(sim, p, 1_000 if quick else args.fuzz),
        "slowloris": lambda p: slowloris(sim, p, 1_100, 30 if quick else 150),
        "noisy": lambda p: noisy(p, 1 if quick else 3, 12 if quick else 40),
        "exfil": lambda p: exfil(sim, p, 1 if quick else 3),
    }
    results: dict[str, Any] = {}
    try:
        for name in args.scenarios.split(","):
            for target, path in targets.items():
                results.setdefault(name, {})[target] = await scenarios[name](path)
                print(name, target, results[name][target], flush=True)
    finally:
        sim.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller runs (a smoke test)")
    parser.add_argument("--old-checkout", help="also run against this checkout's broker, side by side")
    parser.add_argument("--scenarios", default="fuzz,slowloris,noisy,exfil")
    parser.add_argument("--fuzz", type=int, default=10_000, help="fuzzed requests (default: %(default)s)")
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
