"""Waiting for a child process (or a server task) to listen on its loopback port.

A child gives the test no event when it starts listening, so its port is polled, within a bound; a
child that exits meanwhile fails the wait at once, with its log.
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Callable
from pathlib import Path

from tests.helpers.polling import wait_until, wait_until_blocking

Probe = Callable[[int], bool]


def accepts(port: int) -> bool:
    """True when something accepts TCP connections on 127.0.0.1:`port` now."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


def _probe(port: int, proc: subprocess.Popen | None, log: Path | None, probe: Probe) -> Callable[[], bool]:
    def ready() -> bool:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the child exited with {proc.returncode} before listening on {port}: "
                                 f"{_tail(log)}")
        return probe(port)
    return ready


def _tail(log: Path | None) -> str:
    return log.read_text(errors="replace")[-4000:] if log is not None and log.exists() else "(no log)"


async def wait_for_port(port: int, *, proc: subprocess.Popen | None = None, log: Path | None = None,
                        timeout_s: float = 60.0, probe: Probe = accepts) -> None:
    """Wait until `probe(port)` (by default: the port accepts connections) while `proc`, if given, runs;
    fails with the tail of `log` when `proc` exits or `timeout_s` passes."""
    await wait_until(_probe(port, proc, log, probe), timeout_s, lambda: f"nothing on port {port}: {_tail(log)}",
                     interval_s=0.05)


def wait_for_port_blocking(port: int, *, proc: subprocess.Popen | None = None, log: Path | None = None,
                           timeout_s: float = 60.0, probe: Probe = accepts) -> None:
    """`wait_for_port` for synchronous tests and fixtures."""
    wait_until_blocking(_probe(port, proc, log, probe), timeout_s, lambda: f"nothing on port {port}: {_tail(log)}",
                        interval_s=0.05)
