"""The installed package is one namespace: a wheel holds only `mergebroker/`, and its commands run from it."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import zipfile

REPO = pathlib.Path(__file__).resolve().parents[1]


def build_wheel(out: pathlib.Path) -> pathlib.Path:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(REPO)], check=True, capture_output=True, timeout=120)
    return next(out.glob("mergebroker-*.whl"))


def test_the_wheel_installs_only_the_mergebroker_namespace(tmp_path: pathlib.Path) -> None:
    wheel = build_wheel(tmp_path)
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert tops == {"mergebroker", wheel.name.split("-py3")[0] + ".dist-info"}
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("mergebroker/errors.py", "mergebroker/clock.py", "mergebroker/broker/cli.py",
                   "mergebroker/merge/split.py", "mergebroker/breaker/circuit.py", "mergebroker/providers/pool.py"):
        assert module in names
    assert not any(n.startswith("mergebroker/bench") for n in names)


def test_commands_run_from_a_non_editable_install(tmp_path: pathlib.Path) -> None:
    wheel = build_wheel(tmp_path / "dist")
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=120)
    # Run outside the checkout with only the installed copy (plus the venv's dependencies) importable.
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import mergebroker.broker.cli as cli; "
            "assert cli.__file__.startswith(sys.argv[1]), cli.__file__; "
            "sys.argv = ['mergebroker', sys.argv[2], '--help']; sys.exit(cli.main(sys.argv[1:]))")
    for command in ("serve", "simulate", "report", "warm-cache"):
        result = subprocess.run([sys.executable, "-c", code, str(target), command], cwd=tmp_path,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert "usage:" in result.stdout
    bench = subprocess.run([sys.executable, "-c", code.replace("'--help'", "'--quick'"), str(target), "bench"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert bench.returncode == 2 and "runs from a checkout" in bench.stderr
