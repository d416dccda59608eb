"""Server-sent event frames as an Anthropic upstream writes them, for tests that feed streams by hand."""

from __future__ import annotations

import json
from typing import Any


def event(name: str, **data: Any) -> bytes:
    """One SSE frame: `event: name` and a JSON `data` line whose `type` is `name` too."""
    return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n".encode()
