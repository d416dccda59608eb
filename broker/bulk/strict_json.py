"""JSON as the live endpoints accept it: UTF-8, finite numbers, no lone surrogates, bounded nesting.

The same rules as `broker.http.body.parse_json` applies to live request bodies, for one line of a batch
file (the bulk layer may not import the HTTP one). orjson's rules are these, save the depth; only what it
refuses or could misread goes to the standard library, with NaN, Infinity and overflowing numbers refused.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from mergebroker import jsonio

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


class NotStrictJson(ValueError):
    """The text is not JSON the live endpoints accept; the message says why."""


def parse_strict(raw: bytes, max_depth: int) -> Any:
    """The value of `raw`, or `NotStrictJson`."""
    value = jsonio.parse_fast(raw)
    text = None
    if value is jsonio.NOT_PARSED:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise NotStrictJson("is not valid UTF-8") from None
        try:
            value = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
        except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
            raise NotStrictJson("is not valid JSON (NaN, Infinity and numbers past a double are refused)") from None
    if raw.count(b"[") + raw.count(b"{") > max_depth and depth_exceeds(value, max_depth):
        raise NotStrictJson(f"is nested deeper than {max_depth} levels")
    if text is not None and _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(value):
        raise NotStrictJson("holds a lone UTF-16 surrogate (\\ud800-\\udfff) that is not part of a pair")
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
