"""A broker process killed mid-batch (SIGKILL) resumes in its successor without re-sending finished lines."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import openai
import yaml

from mergebroker.providers.simulator.server import answer_for
from tests.conftest import free_port
from tests.helpers.polling import wait_until

LINES = 12


def start(config_path, port: int, log_path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MERGEBROKER_")}
    with log_path.open("ab") as log:
        return subprocess.Popen([sys.executable, "-m", "mergebroker.broker.cli", "serve", "--config", str(config_path),
                                 "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, env=env)


async def until(check, what: str, log_path, timeout_s: float = 60.0):
    """Poll a child process's HTTP state until `check()` returns a truthy value (no event to wait on)."""
    return await wait_until(check, timeout_s, lambda: f"{what}: {log_path.read_text()[-2000:]}", interval_s=0.05,
                            ignoring=(openai.APIConnectionError, openai.APIStatusError))


async def test_killed_broker_resumes_the_batch_in_a_new_process(simulator, tmp_path):
    simulator.set_faults(latency_base_ms=150)
    config = tmp_path / "broker.yaml"
    config.write_text(yaml.safe_dump({
        "providers": [{"name": "sim", "base_url": simulator.url}], "merge": {"embedder": "none"},
        "batches": {"dir": str(tmp_path / "batches"), "concurrency": 1}, "logging": {"level": "warning"}}))
    log_path, port = tmp_path / "broker.log", free_port()
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    rows = [{"custom_id": f"q{n}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "sim-small", "messages": [{"role": "system", "content": f"System {n}"},
                                                          {"role": "user", "content": f"question {n}"}]}}
            for n in range(LINES)]  # distinct system prompts: one call per line
    first = start(config, port, log_path)
    second = None
    try:
        await until(client.models.list, "first broker up", log_path)
        uploaded = await client.files.create(file=("in.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode()),
                                             purpose="batch")
        batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")

        async def progressed():
            seen = await client.batches.retrieve(batch.id)
            return seen if seen.request_counts.completed >= 3 else None

        seen = await until(progressed, "first lines answered", log_path)
        assert seen.request_counts.completed < LINES  # killed mid-batch
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
        calls_before = simulator.stats()["chat_calls"]
        second = start(config, port, log_path)

        async def finished():
            done = await client.batches.retrieve(batch.id)
            return done if done.status == "completed" else None

        done = await until(finished, "batch completed after the restart", log_path)
        assert simulator.stats()["chat_calls"] - calls_before <= LINES - seen.request_counts.completed
        found = {}
        for raw in (await client.files.content(done.output_file_id)).text.splitlines():
            row = json.loads(raw)
            assert row["custom_id"] not in found
            found[row["custom_id"]] = row["response"]["body"]["choices"][0]["message"]["content"]
        assert found == {r["custom_id"]: answer_for(r["body"]["messages"][1]["content"]) for r in rows}
    finally:
        await client.close()
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=20)
