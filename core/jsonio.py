"""JSON in and out of the request path: orjson where it is installed, the standard library otherwise.

orjson parses and writes several times faster than `json`, which matters on the passthrough path (every
request is parsed once and written twice). It differs in two corners that callers may meet: it reads
integers beyond 64 bits as floats (a `seed` would lose digits on its way upstream) and refuses the
non-standard `NaN`/`Infinity` literals. Both functions leave those to the standard library, so whatever
`json` accepted before is still accepted, unchanged, only slower.
"""

from __future__ import annotations

import json
import re
from typing import Any

try:
    import orjson
except ImportError:  # pragma: no cover - orjson is a dependency; the fallback keeps a bare install working
    orjson = None  # type: ignore[assignment]

_LONG_DIGITS = re.compile(rb"\d{19}")  # 19 digits may exceed 64 bits; orjson would read it as a float


NOT_PARSED: Any = object()
"""What `parse_fast` returns when it leaves the text to the standard library."""


def parse_fast(raw: bytes | str) -> Any:
    """orjson's reading of `raw`, or `NOT_PARSED` when orjson is absent, refuses the text, or could misread it.

    What orjson accepts is strict JSON: UTF-8, finite numbers, no lone surrogates, at most 1024 levels.
    """
    if orjson is None or _LONG_DIGITS.search(raw if isinstance(raw, bytes) else raw.encode()):
        return NOT_PARSED
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return NOT_PARSED  # possibly valid for `json` (NaN, deep nesting): let it decide


def loads(raw: bytes | str) -> Any:
    """Parse JSON; raises a `ValueError` (or `UnicodeDecodeError`, `RecursionError`) for bad input."""
    value = parse_fast(raw)
    return json.loads(raw) if value is NOT_PARSED else value


def dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON bytes for `obj` (dicts with string keys, lists, scalars)."""
    if orjson is not None:
        try:
            return orjson.dumps(obj)
        except TypeError:
            pass  # an integer beyond 64 bits or a non-string key: the standard library writes those
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
