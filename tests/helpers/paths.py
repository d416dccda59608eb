"""Where the repository's files are, for tests in any room of `tests/`."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
DATA = TESTS / "data"
SCHEMAS = TESTS / "schemas"
