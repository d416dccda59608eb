"""`mergebroker serve` with no config and no keys runs against the built-in simulated upstream and says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

from tests.conftest import free_port
from tests.helpers.processes import wait_for_port_blocking


def _get(url: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as resp:
        return resp.status, json.loads(resp.read())


def test_serve_without_config_answers_from_the_simulated_upstream_and_logs_it(tmp_path):
    port = free_port()
    log_path = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MERGEBROKER_")}
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "mergebroker.broker.cli", "serve", "--port", str(port)],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_for_port_blocking(port, proc=proc, log=log_path)
        status, body = _get(f"http://127.0.0.1:{port}/v1/chat/completions",
                            {"model": "sim-small", "messages": [{"role": "user", "content": "hello"}],
                             "broker": {"merge": False}})
        assert status == 200 and body["choices"][0]["message"]["content"].startswith("Answer ")
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    events = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    assert any(e.get("event") == "simulated_upstream" and e.get("level") == "warning" for e in events)
    assert any(e.get("event") == "request" and e.get("status") == 200 for e in events)
    # Installed, so taken: uvloop, and aiohttp's compiled HTTP parser (the pure-Python one is several times slower).
    assert any(e.get("event") == "event_loop" and e.get("kind") == "uvloop" and e.get("http_parser") == "c"
               for e in events)
