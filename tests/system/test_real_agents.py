"""The real agent clients complete a task that needs a tool call through the broker, offline.

Codex CLI (`codex exec`, a custom provider with `wire_api = "responses"`) goes through `POST /v1/responses`;
Claude Code (`claude -p`, `ANTHROPIC_BASE_URL`) through `POST /v1/messages`. Behind the broker, as real processes,
runs the simulated upstream (`mergebroker simulate`) in the mode each test names; its agent rule runs the shell
command the prompt quotes between backticks, so the file it writes proves the tool call made the round trip.
Skipped where the clients are not installed (scripts/agent_clients.sh installs them into .agents/).
How each client is driven, and what it sends and needs: bench/agents/README.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

from bench.agents.clients import AgentRun, claude_run, codex_run, find_client
from tests.conftest import free_port

PROMPT = "Create a file named result.txt containing the word ready, using the shell: run `echo ready > result.txt`"
CLIENT_TIMEOUT_S = 120
START_TIMEOUT_S = 90
SIM_KEY = "sim-key"

pytestmark = pytest.mark.timeout(3 * CLIENT_TIMEOUT_S)


@cache
def installed(name: str) -> str | None:
    """The client's binary when it is installed and starts (`--version`), else None."""
    binary = find_client(name)
    if binary is None:
        return None
    try:
        subprocess.run([binary, "--version"], capture_output=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return binary


def client_or_skip(name: str) -> str:
    binary = installed(name)
    if binary is None:
        pytest.skip(f"{name} is not installed or does not start here: run scripts/agent_clients.sh")
    return binary


class Child:
    """A mergebroker command running as a child process, its output in a log file."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "mergebroker.broker.cli", *args], stdout=out,
                                         stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})

    def wait_until_answers(self, url: str) -> None:
        """Poll `url` until it answers 200 (a child process signals readiness no other way)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"{self.log.name} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.1)
        pytest.fail(f"{url} did not answer within {START_TIMEOUT_S} s:\n{self.tail()}")

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


class Stack:
    """A simulated upstream and a broker in front of it, both real processes on loopback ports."""

    def __init__(self, tmp: Path, sim_args: list[str], provider: dict) -> None:
        """`provider`: the broker's settings for the simulator (kind, ...), less its base_url and key."""
        self.tmp = tmp
        sim_port, broker_port = free_port(), free_port()
        self.sim_url = f"http://127.0.0.1:{sim_port}"
        self.url = f"http://127.0.0.1:{broker_port}"
        self.children: list[Child] = []
        sim = Child(["simulate", "--port", str(sim_port), *sim_args], tmp / "simulator.log")
        self.children.append(sim)
        sim.wait_until_answers(self.sim_url + "/v1/models")
        config = {"server": {"host": "127.0.0.1", "port": broker_port}, "merge": {"embedder": "none"},
                  "providers": [{"name": "sim", "base_url": self.sim_url + "/v1", "api_key_env": "MB_SIM_KEY",
                                 **provider}]}
        (tmp / "broker.yaml").write_text(json.dumps(config))  # JSON is YAML
        self.broker = Child(["serve", "--config", str(tmp / "broker.yaml"), "--port", str(broker_port)],
                            tmp / "broker.log", env={"MB_SIM_KEY": SIM_KEY})
        self.children.append(self.broker)
        self.broker.wait_until_answers(self.url + "/readyz")

    def upstream_calls(self) -> dict[str, int]:
        """The simulator's call counters by endpoint (chat_completions, messages, ...)."""
        with urllib.request.urlopen(self.sim_url + "/stats", timeout=5) as reply:
            return json.load(reply)["calls"]

    def stop(self) -> None:
        for child in reversed(self.children):
            child.stop()


@pytest.fixture
def stack(tmp_path: Path) -> Iterator:
    """Factory: `stack(sim_args, provider)` starts a simulator and a broker; both are stopped at the end."""
    started: list[Stack] = []

    def start(sim_args: list[str], provider: dict) -> Stack:
        started.append(Stack(tmp_path, sim_args, provider))
        return started[-1]

    yield start
    for s in started:
        s.stop()


def run_agent(run: AgentRun, stack: Stack) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(run.argv, check=False, cwd=run.cwd, env=run.env, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{Path(run.argv[0]).name} ran past {CLIENT_TIMEOUT_S} s:\n{exc.stdout}\n{exc.stderr}\n"
                    f"broker:\n{stack.broker.tail()}")


def assert_task_done(done: subprocess.CompletedProcess, workdir: Path, stack: Stack) -> None:
    """The client exited 0 and the shell command it ran through the broker wrote result.txt."""
    context = f"exit {done.returncode}\nstdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}\n" \
              f"broker:\n{stack.broker.tail()}"
    assert done.returncode == 0, context
    result = workdir / "result.txt"
    assert result.exists(), "the tool call never ran: no result.txt\n" + context
    assert result.read_text().strip() == "ready", context


def dirs(tmp_path: Path) -> tuple[Path, Path]:
    """A fresh working directory for the client and a throwaway HOME (never the user's own config)."""
    workdir, home = tmp_path / "work", tmp_path / "home"
    workdir.mkdir()
    home.mkdir()
    return workdir, home


def codex_task(stack: Stack, tmp_path: Path) -> tuple[subprocess.CompletedProcess, Path]:
    workdir, home = dirs(tmp_path)
    run = codex_run(client_or_skip("codex"), base_url=stack.url + "/v1", model="sim-small", prompt=PROMPT,
                    workdir=workdir, home=home)
    return run_agent(run, stack), workdir


def claude_task(stack: Stack, tmp_path: Path) -> tuple[subprocess.CompletedProcess, Path]:
    workdir, home = dirs(tmp_path)
    run = claude_run(client_or_skip("claude"), base_url=stack.url, model="claude-haiku-4-5", prompt=PROMPT,
                     workdir=workdir, home=home)
    return run_agent(run, stack), workdir


def test_codex_runs_a_shell_command_through_an_upstream_serving_responses(stack, tmp_path):
    client_or_skip("codex")
    upstream = stack([], {})
    done, workdir = codex_task(upstream, tmp_path)
    assert_task_done(done, workdir, upstream)
    calls = upstream.upstream_calls()
    assert calls.get("chat_completions", 0) == 0 and calls.get("messages", 0) == 0, calls


def test_codex_runs_a_shell_command_through_a_chat_only_upstream(stack, tmp_path):
    client_or_skip("codex")
    upstream = stack(["--no-responses"], {})
    done, workdir = codex_task(upstream, tmp_path)
    assert_task_done(done, workdir, upstream)
    assert upstream.upstream_calls().get("chat_completions", 0) >= 2  # the tool call's turn and the answer's


def test_claude_code_runs_bash_through_an_anthropic_upstream(stack, tmp_path):
    client_or_skip("claude")
    upstream = stack([], {"kind": "anthropic"})
    done, workdir = claude_task(upstream, tmp_path)
    assert_task_done(done, workdir, upstream)
    calls = upstream.upstream_calls()
    assert calls.get("messages", 0) >= 2 and calls.get("chat_completions", 0) == 0, calls


def test_claude_code_runs_bash_through_an_openai_compatible_upstream(stack, tmp_path):
    client_or_skip("claude")
    upstream = stack(["--no-responses"], {})
    done, workdir = claude_task(upstream, tmp_path)
    assert_task_done(done, workdir, upstream)
    calls = upstream.upstream_calls()
    assert calls.get("chat_completions", 0) >= 2 and calls.get("messages", 0) == 0, calls
