"""A user who installs the wheel gets a working product: the wheel is built once from the checkout's files,
installed (not editable) into a fresh virtual environment, and every command runs from there, outside the
checkout, against loopback servers only.

The fresh environment sees the project environment's dependencies through a `.pth` line. The editable
install's finder stays inactive there (`.pth` files in a directory added by a `.pth` are not processed), so
`mergebroker` can only come from the wheel; the `install` fixture checks that.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import free_port
from tests.helpers.paths import REPO

pytestmark = pytest.mark.timeout(90)

# Each source folder and where setup.py installs it.
LAYERS = {"core": "mergebroker", "merge": "mergebroker/merge", "breaker": "mergebroker/breaker",
          "providers": "mergebroker/providers", "broker": "mergebroker/broker"}
BUILD_FILES = ("pyproject.toml", "setup.py", "README.md")
START_S = 60  # a command's longest start on a loaded two-core machine (imports, a model, Redis)


def source_files() -> list[str]:
    """The checkout's files as git sees them: tracked, and new ones not ignored (what `pip install .` picks up)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            check=True, capture_output=True, timeout=30).stdout.decode()
    return sorted({path for path in listed.split("\0") if path and (REPO / path).is_file()})


def installed_path(source: str) -> str | None:
    """Where a source file lands in the wheel (None: not installed)."""
    top, _, rest = source.partition("/")
    return f"{LAYERS[top]}/{rest}" if top in LAYERS and rest else None


def stage(files: dict[str, str], dest: Path) -> Path:
    """Copy `files` (target path -> checkout path) into `dest`, so stale build/ folders never reach a wheel."""
    for target, source in files.items():
        (dest / target).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / source, dest / target)
    return dest


def build_wheel(src: Path, out: Path) -> Path:
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-index",
                             "--no-build-isolation", "-w", str(out), str(src)],
                            check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return next(out.glob("mergebroker-*.whl"))


def dockerfile_files(sources: list[str]) -> dict[str, str]:
    """The files the Dockerfile's COPY lines put into its WORKDIR, where it runs `pip install .`
    (target path there -> checkout path)."""
    files: dict[str, str] = {}
    workdir = Path("/")
    for line in (REPO / "Dockerfile").read_text().splitlines():
        words = line.split()
        if words[:1] == ["WORKDIR"]:
            workdir = workdir / words[1]
        if words[:1] != ["COPY"] or any(w.startswith("--from") for w in words):
            continue
        *srcs, raw = [w for w in words[1:] if not w.startswith("--")]
        dest = (workdir / raw).relative_to(workdir)  # a destination outside WORKDIR fails here, loudly
        into = raw.endswith("/") or len(srcs) > 1
        for src in (s.rstrip("/") for s in srcs):
            if src in sources:
                files[str(dest / Path(src).name if into else dest)] = src
            for path in (p for p in sources if p.startswith(src + "/")):
                files[str(dest / path.removeprefix(src + "/"))] = path
    return files


@pytest.fixture(scope="module")
def sources() -> list[str]:
    return source_files()


@pytest.fixture(scope="module")
def wheel(sources: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("wheel")
    package = {p: p for p in sources if installed_path(p) or p in BUILD_FILES}
    return build_wheel(stage(package, root / "src"), root / "dist")


@dataclass(frozen=True)
class Install:
    """A fresh venv holding the wheel, and a scratch directory outside the checkout where commands run."""

    venv: Path
    work: Path
    env: dict[str, str]

    @property
    def python(self) -> str:
        return str(self.venv / "bin" / "python")

    @property
    def mergebroker(self) -> str:
        return str(self.venv / "bin" / "mergebroker")

    def run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run `mergebroker ARGS` to its end."""
        return subprocess.run([self.mergebroker, *args], check=False, cwd=self.work, env=self.env,
                              capture_output=True, text=True, timeout=timeout)

    def config(self, name: str, settings: dict[str, Any]) -> Path:
        path = self.work / f"{name}.yaml"
        path.write_text(yaml.safe_dump({"logging": {"level": "info"}, **settings}))
        return path


@pytest.fixture(scope="module")
def install(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Install:
    root = tmp_path_factory.mktemp("install")
    venv, work = root / "venv", root / "work"
    work.mkdir()
    python = str(venv / "bin" / "python")
    # No pip inside (ensurepip costs seconds): the project's pip installs into the fresh interpreter.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    pip = subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps",
                          "--no-index", str(wheel)], check=False, capture_output=True, text=True, timeout=120)
    assert pip.returncode == 0, pip.stderr[-3000:]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MERGEBROKER_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")

    def python_says(code: str) -> str:
        return subprocess.run([python, "-c", code], check=True, capture_output=True, text=True, cwd=work, env=env,
                              timeout=30).stdout.strip()

    site = python_says("import sysconfig; print(sysconfig.get_path('purelib'))")
    Path(site, "project_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    where = python_says("import mergebroker; print(mergebroker.__file__)")
    assert Path(where).is_relative_to(site), f"mergebroker imports from {where}, not the wheel in {site}"
    return Install(venv, work, env)


class Child:
    """A `mergebroker` command running in the background; its output goes to a log shown when a test fails."""

    def __init__(self, install: Install, name: str, args: list[str]) -> None:
        self.log = install.work / f"{name}.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen([install.mergebroker, *args], cwd=install.work, env=install.env,
                                         stdout=out, stderr=subprocess.STDOUT)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Signal the command and wait for it to end (killed if it outstays its drain); its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.contextmanager
def running(install: Install, name: str, *args: str) -> Iterator[Child]:
    child = Child(install, name, list(args))
    try:
        yield child
    finally:
        child.stop()


def http(url: str, body: dict[str, Any] | None = None) -> tuple[int, str]:
    """GET (or POST `body` as JSON to) a loopback URL: the status and the text of the answer."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def wait_for(child: Child, url: str, ready=lambda status, text: status == 200) -> str:
    """Poll `url` until `ready(status, text)`; the child must stay up meanwhile. Returns the last text."""
    deadline = time.monotonic() + START_S
    while True:
        assert child.proc.poll() is None, child.output()[-4000:]
        with contextlib.suppress(OSError):
            status, text = http(url)
            if ready(status, text):
                return text
        assert time.monotonic() < deadline, f"{url} never ready:\n{child.output()[-4000:]}"
        time.sleep(0.1)  # polling a child process: there is no event to wait on


def chat(port: int, content: str) -> dict[str, Any]:
    status, text = http(f"http://127.0.0.1:{port}/v1/chat/completions",
                        {"model": "sim-small", "temperature": 0,  # deterministic: a repeat may be cached
                         "messages": [{"role": "user", "content": content}]})
    assert status == 200, text
    return json.loads(text)


def metric(port: int, name: str, **labels: str) -> float:
    _status, text = http(f"http://127.0.0.1:{port}/metrics")
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and labels.items() <= s.labels.items())


@dataclass(frozen=True)
class Upstream:
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


@pytest.fixture(scope="module")
def upstream(install: Install) -> Iterator[Upstream]:
    """`mergebroker simulate --quiz` of the fresh venv: the upstream of the tests below that need one."""
    port = free_port()
    with running(install, "simulate", "simulate", "--port", str(port), "--quiz") as child:
        wait_for(child, f"http://127.0.0.1:{port}/v1/models")
        yield Upstream(port)


def test_the_wheel_holds_every_module_of_the_source_tree_and_only_the_mergebroker_namespace(
        wheel: Path, sources: list[str]) -> None:
    """Every file under the package folders lands at its installed path; nothing else is installed."""
    names = set(zipfile.ZipFile(wheel).namelist())
    dist_info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
    assert {n.split("/")[0] for n in names} == {"mergebroker", dist_info}
    expected = {installed_path(p) for p in sources if installed_path(p)}
    assert sorted(expected - names) == [], "source files missing from the wheel"
    assert sorted(n for n in names - expected if not n.startswith(dist_info)) == [], "files from nowhere"
    assert "mergebroker = mergebroker.broker.cli:main" in zipfile.ZipFile(wheel).read(
        f"{dist_info}/entry_points.txt").decode()


def test_every_installed_module_imports_from_the_fresh_venv(install: Install, sources: list[str]) -> None:
    """`pkgutil.walk_packages` over the installed package imports every module (the optional mcp ones too)."""
    code = ("import importlib, json, pkgutil, mergebroker\n"
            "found = {}\n"
            "def failed(name): found[name] = 'cannot walk'\n"
            "for info in pkgutil.walk_packages(mergebroker.__path__, 'mergebroker.', onerror=failed):\n"
            "    try: found[info.name] = importlib.import_module(info.name).__file__\n"
            "    except Exception as exc: found[info.name] = f'{type(exc).__name__}: {exc}'\n"
            "print(json.dumps(found))\n")
    result = subprocess.run([install.python, "-c", code], check=False, cwd=install.work, env=install.env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout)
    modules = {path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
               for path in map(installed_path, sources) if path and path.endswith(".py")} - {"mergebroker"}
    assert sorted(found) == sorted(modules)
    assert any(name.startswith("mergebroker.broker.mcp.") for name in found)
    site = install.venv.resolve()
    assert {name: where for name, where in found.items() if not Path(where).resolve().is_relative_to(site)} == {}


def test_the_dockerfile_copies_everything_the_wheel_is_built_from(
        wheel: Path, sources: list[str], tmp_path: Path) -> None:
    """`pip install .` over exactly what the Dockerfile copies builds the same package as the checkout."""
    docker = build_wheel(stage(dockerfile_files(sources), tmp_path / "app"), tmp_path / "dist")

    def package(path: Path) -> set[str]:
        return {n for n in zipfile.ZipFile(path).namelist() if n.startswith("mergebroker/")}

    assert package(docker) == package(wheel)


def test_serve_without_config_answers_from_the_built_in_simulated_upstream(install: Install) -> None:
    """No config and no key: `mergebroker serve` says it uses the simulated upstream and answers a chat."""
    port = free_port()
    with running(install, "serve-bare", "serve", "--port", str(port)) as child:
        wait_for(child, f"http://127.0.0.1:{port}/healthz")
        reply = chat(port, "What is a circuit breaker?")
    assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["content"]
    assert '"simulated_upstream"' in child.output()


def test_serve_records_its_chats_in_the_ledger_and_report_counts_them(install: Install) -> None:
    """Chats answered by `serve` reach the SQLite ledger by a graceful stop; `report` counts them."""
    ledger = install.work / "ledger.sqlite3"
    config = install.config("ledger", {"ledger": {"path": str(ledger)}, "merge": {"embedder": "none"}})
    port = free_port()
    with running(install, "serve-ledger", "serve", "--config", str(config), "--port", str(port)) as child:
        wait_for(child, f"http://127.0.0.1:{port}/healthz")
        for question in ("First question?", "Second question?", "Third question?", "First question?"):
            chat(port, question)
        assert child.stop(signal.SIGTERM) == 0, child.output()[-4000:]
    result = install.run("report", "--ledger", str(ledger), "--format", "json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["requests"], report["cache_hits"], report["failed"]) == (4, 1, 0), report
    table = install.run("report", "--ledger", str(ledger))
    assert table.returncode == 0 and re.search(r"^\s*requests\s+4\s", table.stdout, re.MULTILINE), table.stdout


@pytest.mark.redis
def test_a_worker_joins_the_cluster_on_redis_and_a_front_end_answers_through_it(
        install: Install, upstream: Upstream, redis_server) -> None:
    """`mergebroker worker` is ready with its cluster check; a `serve` front-end's chat is answered by it."""
    cluster = {"enabled": True, "partitions": 4, "block_ms": 200,
               "local_without_workers": False}  # the chat can only be answered through Redis and the worker
    config = install.config("cluster", {"providers": [{"name": "sim", "base_url": upstream.url}],
                                        "redis": {"url": redis_server.url}, "cluster": cluster,
                                        "merge": {"embedder": "none"}})
    worker_port, front_port = free_port(), free_port()
    with running(install, "worker", "worker", "--config", str(config), "--metrics-port", str(worker_port)) as worker, \
            running(install, "front-end", "serve", "--config", str(config), "--port", str(front_port)) as front:
        ready = json.loads(wait_for(worker, f"http://127.0.0.1:{worker_port}/readyz"))
        assert ready["ready"] is True and ready["checks"]["cluster"] is True, ready
        wait_for(front, f"http://127.0.0.1:{front_port}/healthz")
        before = metric(worker_port, "mergebroker_cluster_jobs_total", outcome="answered")
        reply = chat(front_port, "Which worker answers this?")
        after = metric(worker_port, "mergebroker_cluster_jobs_total", outcome="answered")
    assert reply["object"] == "chat.completion", reply
    assert after == before + 1, worker.output()[-3000:] + front.output()[-3000:]


async def test_mcp_over_stdio_answers_tool_calls_through_the_sdk_client(install: Install, upstream: Upstream) -> None:
    """The fresh venv's `mergebroker mcp`, launched by the MCP SDK's stdio client, answers count_tokens and chat."""
    from mcp import Client, StdioServerParameters

    config = install.config("mcp", {"providers": [{"name": "sim", "base_url": upstream.url}],
                                    "merge": {"embedder": "none"}, "logging": {"level": "warning"}})
    params = StdioServerParameters(command=install.mergebroker, args=["mcp", "--config", str(config)],
                                   env={**install.env, "MERGEBROKER_API_KEY": "sk-packaging-test"},
                                   cwd=str(install.work))
    async with asyncio.timeout(START_S):
        async with Client(params, read_timeout_seconds=START_S) as client:
            tokens = await client.call_tool("count_tokens", {"text": "an installed broker counts tokens"})
            answer = await client.call_tool("chat", {"model": "sim-small",
                                                     "messages": [{"role": "user", "content": "Are you there?"}]})
    assert not tokens.is_error and tokens.structured_content["tokens"] > 0, tokens
    assert not answer.is_error and answer.content[0].text, answer


def test_simulate_serves_the_model_list_and_chats(upstream: Upstream) -> None:
    """`mergebroker simulate` (the `upstream` fixture) lists its models and answers a chat."""
    status, text = http(upstream.url + "/models")
    assert status == 200 and "sim-small" in {m["id"] for m in json.loads(text)["data"]}
    assert chat(upstream.port, "Hello, simulator?")["object"] == "chat.completion"


@pytest.mark.model
def test_warm_cache_embeds_a_file_with_the_local_model(install: Install) -> None:
    """`mergebroker warm-cache` embeds each line with the built-in model; a repeated line is already cached."""
    config = install.config("warm", {"providers": [{"name": "local", "kind": "local", "models": ["all-MiniLM-L6-v2"]}],
                                     "merge": {"embedder": "none"}})
    texts = install.work / "texts.txt"
    texts.write_text("a circuit breaker\n\nrate limits per tier\na circuit breaker\n")
    result = install.run("warm-cache", str(texts), "--config", str(config), "--batch", "1", timeout=90)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "3 texts embedded, 1 were already cached" in result.stderr
    assert "embedding_model_loaded" in result.stdout + result.stderr


def test_eval_runs_a_small_set_against_a_simulated_upstream_and_writes_its_report(
        install: Install, upstream: Upstream) -> None:
    """`mergebroker eval` runs 8 built-in questions alone and in pairs and writes eval.json and eval.md."""
    out = install.work / "eval-report"
    result = install.run("eval", "--upstream", upstream.url, "--model", "sim-small", "--builtin", "8",
                         "--batch-sizes", "2", "--no-progress", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "eval.json").read_text())
    assert (report["requests"], report["alone_failed"], report["alone_accuracy"]) == (8, 0, 1.0), report
    assert [size["batch_size"] for size in report["sizes"]] == [2]
    assert "max_batch" in (out / "eval.md").read_text()


def test_bench_outside_a_checkout_exits_2_and_says_it_needs_one(install: Install) -> None:
    """bench/ is not installed: `mergebroker bench` away from a checkout refuses clearly."""
    result = install.run("bench", "--quick")
    assert result.returncode == 2, result.stderr
    assert "runs from a checkout" in result.stderr
