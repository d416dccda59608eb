"""`bench/` has one entry point over a typed registry: every benchmark module is registered, each runs from
`python -m bench NAME`, and the report renders exactly the registry's report set."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from bench.registry import BENCHMARKS, BY_NAME
from tests.helpers.paths import REPO

BENCH = REPO / "bench"
NOT_BENCHMARKS = {"report", "__main__", "registry"}  # the entry points themselves


def _has_main(path: Path) -> bool:
    return any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in ast.parse(path.read_text()).body)


def test_every_benchmark_module_is_registered_and_each_entry_resolves():
    runnable = {p.stem for p in BENCH.glob("*.py") if _has_main(p)} - NOT_BENCHMARKS
    assert runnable == set(BY_NAME)
    assert all(callable(b.entry()) for b in BENCHMARKS)


def test_the_report_renders_the_registrys_report_set():
    from bench.report import PARTS

    assert list(PARTS) == [b.report for b in BENCHMARKS if b.report]
    assert all(hasattr(part, name) for part in PARTS.values()
               for name in ("smoke", "targets", "findings", "sections", "figures"))


def test_python_m_bench_lists_runs_and_refuses_unknown_names():
    listed = subprocess.run([sys.executable, "-m", "bench"], capture_output=True, text=True, timeout=60,
                            cwd=BENCH.parent)
    assert listed.returncode == 0 and all(b.name in listed.stdout for b in BENCHMARKS)
    helped = subprocess.run([sys.executable, "-m", "bench", "passthrough", "--help"], capture_output=True, text=True,
                            timeout=60, cwd=BENCH.parent)
    assert helped.returncode == 0 and "--quick" in helped.stdout
    unknown = subprocess.run([sys.executable, "-m", "bench", "nope"], capture_output=True, text=True, timeout=60,
                             cwd=BENCH.parent)
    assert unknown.returncode == 2 and "nope" in unknown.stderr
