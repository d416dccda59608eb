"""Run a real agent client against the scripted stub (bench/agents/stub.py) and save what it sent.

    python -m bench.agents.capture [codex|claude ...] [--out tests/data/agents]

For each client: starts the stub on a loopback port, runs one task that needs a shell call (the stub answers turn 1
with the call and turn 2 with text), checks the command's effect, and writes the first turn and the turn after the
tool ran to `<client>_turn1.json` and `<client>_turn2.json`, credentials redacted; every request's method and path
are printed. Exit status 0 when every client completed the round trip.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from aiohttp import web

from bench.agents.clients import AgentRun, claude_run, codex_run, find_client
from bench.agents.stub import Recorded, StubModel, create_app

SECRET_HEADERS = {"authorization", "x-api-key", "api-key"}
PROMPT = "Create a file named result.txt containing the word ready, using the shell: run `echo ready > result.txt`"
TIMEOUT_S = 120


def redacted(record: Recorded) -> dict:
    """A record with its credentials replaced, ready to be saved."""
    headers = {k: ("<redacted>" if k.lower() in SECRET_HEADERS else v) for k, v in record.headers.items()}
    return {**asdict(record), "headers": headers}


async def run_client(run: AgentRun, timeout_s: float = TIMEOUT_S) -> tuple[int, str]:
    """Run one client to completion; (exit status, its output). A client past `timeout_s` is killed (status -9)."""
    proc = await asyncio.create_subprocess_exec(*run.argv, cwd=run.cwd, env=run.env, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        output, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        output, _ = await proc.communicate()
    return proc.returncode if proc.returncode is not None else -9, output.decode(errors="replace")


def _build(client: str, binary: str, base: str, workdir: Path, home: Path) -> AgentRun:
    if client == "codex":
        return codex_run(binary, base_url=base + "/v1", model="stub-model", prompt=PROMPT, workdir=workdir, home=home)
    return claude_run(binary, base_url=base, model="claude-haiku-4-5", prompt=PROMPT, workdir=workdir, home=home)


async def capture(client: str, out: Path) -> bool:
    """Round-trip one client through the stub; saves its requests under `out`; True when the tool's effect shows."""
    binary = find_client(client)
    if binary is None:
        print(f"{client}: not installed (scripts/agent_clients.sh)", file=sys.stderr)
        return False
    stub = StubModel(command="echo ready > result.txt")
    runner = web.AppRunner(create_app(stub), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        with tempfile.TemporaryDirectory(prefix=f"mb-{client}-") as tmp:
            workdir, home = Path(tmp, "work"), Path(tmp, "home")
            workdir.mkdir()
            status, output = await run_client(_build(client, binary, f"http://127.0.0.1:{port}", workdir, home))
            effect = (workdir / "result.txt").read_text() if (workdir / "result.txt").exists() else None
    finally:
        await runner.cleanup()
    records = [redacted(r) for r in stub.requests]
    out.mkdir(parents=True, exist_ok=True)
    turns = [r for r in records if r["path"] in ("/v1/responses", "/v1/messages")]
    for number, record in enumerate(turns[:2], start=1):
        (out / f"{client}_turn{number}.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"{client}: exit {status}, result.txt={effect!r}, requests: "
          + ", ".join(f"{r['method']} {r['path']}" for r in records))
    if status != 0 or effect is None:
        print(output[-4000:], file=sys.stderr)
    return status == 0 and effect is not None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("clients", nargs="*", help="codex, claude (default: both)")
    parser.add_argument("--out", type=Path, default=Path("tests/data/agents"))
    args = parser.parse_args(argv)
    if unknown := set(args.clients) - {"codex", "claude"}:
        parser.error(f"unknown clients: {', '.join(sorted(unknown))}")
    args.clients = args.clients or ["codex", "claude"]
    results = [asyncio.run(capture(client, args.out)) for client in args.clients]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
