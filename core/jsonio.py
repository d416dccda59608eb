"""JSON in and out of the request path: orjson where it is installed, the standard library otherwise.

orjson parses and writes several times faster than `json`, which matters on the passthrough path (every
request is parsed once and written twice). It differs in two corners that callers may meet: it reads
integers beyond 64 bits as floats (a `seed` would lose digits on its way upstream) and refuses the
non-standard `NaN`/`Infinity` literals. Both functions leave those to the standard library, so whatever
`json` accepted before is still accepted, unchanged, only slower.

`parse_strict` is JSON as the live endpoints accept it (UTF-8, finite numbers, no lone surrogates, bounded
nesting): the one rule for request bodies (`broker.http.body`) and Batch API lines (`broker.bulk.lines`).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

try:
    import orjson
except ImportError:  # pragma: no cover - orjson is a dependency; the fallback keeps a bare install working
    orjson = None  # type: ignore[assignment]

# 19 digits in a row may exceed 64 bits, which orjson would read as a float. Found by mapping every digit to
# "0" and everything else to " " (one C pass) and searching for 19 zeros: a regex takes ten times longer.
_DIGITS_AS_ZERO = bytes(48 if 48 <= b <= 57 else 32 for b in range(256))
_LONG_RUN = b"0" * 19


NOT_PARSED: Any = object()
"""What `parse_fast` returns when it leaves the text to the standard library."""


def parse_fast(raw: bytes | str) -> Any:
    """orjson's reading of `raw`, or `NOT_PARSED` when orjson is absent, refuses the text, or could misread it.

    What orjson accepts is strict JSON: UTF-8, finite numbers, no lone surrogates, at most 1024 levels.
    """
    if orjson is None or _has_long_digit_run(raw if isinstance(raw, bytes) else raw.encode()):
        return NOT_PARSED
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return NOT_PARSED  # possibly valid for `json` (NaN, deep nesting): let it decide


def _has_long_digit_run(raw: bytes) -> bool:
    return _LONG_RUN in raw.translate(_DIGITS_AS_ZERO)


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


# Strict JSON: as the live endpoints accept it (request bodies and Batch API lines alike).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


class NotStrictJson(ValueError):
    """The text is not JSON the live endpoints accept; the message says why (it reads after "the text ..."),
    and `reason` names the rule broken: "json" (not valid UTF-8 or JSON), "depth" or "surrogate"."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def parse_strict(raw: bytes, max_depth: int) -> Any:
    """The value of `raw`, or `NotStrictJson`."""
    value = parse_fast(raw)  # orjson's rules are these (save the depth): only its refusals need more
    text = None
    if value is NOT_PARSED:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise NotStrictJson("is not valid UTF-8", "json") from None
        try:
            value = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
        except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
            raise NotStrictJson("is not valid JSON (NaN, Infinity and numbers past a double are refused)",
                                "json") from None
    if raw.count(b"[") + raw.count(b"{") > max_depth and depth_exceeds(value, max_depth):
        raise NotStrictJson(f"is nested deeper than {max_depth} levels", "depth")
    if text is not None and _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(value):
        raise NotStrictJson("holds a lone UTF-16 surrogate (\\ud800-\\udfff) that is not part of a pair",
                            "surrogate")
    return value


def depth_exceeds(value: Any, max_depth: int) -> bool:
    """True when containers in `value` nest deeper than `max_depth` (iterative: no recursion limit)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                if depth + 1 > max_depth:
                    return True
                stack.append((child, depth + 1))
    return False


def _has_lone_surrogate(value: Any) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise ValueError(f"{literal} overflows a double")
    return value
