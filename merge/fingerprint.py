"""Cache and coalescing keys: a SHA-256 over a canonical JSON of everything that shapes the answer.

Two requests get the same fingerprint only when an upstream would treat them alike: message text is
compared stripped, with whitespace runs collapsed and lower-cased (each configurable; see README,
"Exact duplicates", for what that trades away), an absent field equals a null
one, `1` equals `1.0`, and `max_completion_tokens` stands in for `max_tokens`. Every other body field
is part of the key, known or not (`top_k`, `min_p`, `service_tier`, vendor extensions...), except the
few in `NON_ANSWER_FIELDS` that cannot change the answer: an unknown field is assumed to matter,
because a false cache hit is worse than a miss.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import orjson

from mergebroker.output_budget import token_budget

# Body fields that do not change the answer: who asks (`user`, `safety_identifier`), how it is
# delivered (`stream`, `stream_options`), what the upstream keeps or logs (`store`, `metadata`),
# a provider-side prompt-cache routing hint (`prompt_cache_key`) and the broker's own options.
NON_ANSWER_FIELDS = frozenset({
    "user", "safety_identifier", "stream", "stream_options", "store", "metadata", "prompt_cache_key", "broker",
})
# Fields canonicalised apart from the rest: the messages, stop, and the two names of the token limit.
_SPECIAL_FIELDS = frozenset({"messages", "stop", "max_tokens", "max_completion_tokens"})
_NOT_FIELDS = NON_ANSWER_FIELDS | _SPECIAL_FIELDS


def normalize_text(text: str, *, lowercase: bool, collapse_whitespace: bool = True) -> str:
    """Strip `text`, collapse every whitespace run to one space (unless told not to) and optionally lower-case it."""
    # `str.split()` splits at the same whitespace as the regex `\s+` (both ask `str.isspace`), several times faster.
    text = " ".join(text.split()) if collapse_whitespace else text.strip()
    return text.lower() if lowercase else text


def chat_fingerprint(body: Mapping[str, Any], *, lowercase: bool = True, collapse_whitespace: bool = True,
                     cache_version: str = "1") -> str:
    """Return the hex SHA-256 key of a chat completion body (see the module docstring for the rule)."""
    # Body fields sit under their own key, so a field named like one of ours ("kind") cannot collide.
    canonical: dict[str, Any] = {
        "kind": "chat",
        "cache_version": cache_version,
        "fields": canonical_fields(body, _NOT_FIELDS),
        "messages": [_canonical_message(m, lowercase, collapse_whitespace) for m in body.get("messages") or []],
    }
    max_tokens = token_budget(body, 0)  # the one rule: the same budget, however the body names it
    if max_tokens:
        canonical["max_tokens"] = max_tokens
    stop = body.get("stop")
    if stop is not None:  # most requests have none, and a null one canonicalises to none
        stop = canonical_stop(stop)
        if stop is not None:
            canonical["stop"] = stop
    return json_digest(canonical)


def canonical_fields(body: Mapping[str, Any], skip: frozenset[str]) -> dict[str, Any]:
    """Every field of `body` but those named in `skip`, made canonical (`canonical_value`). Nulls are left out as
    they are met (an absent field equals a null one) rather than dropped in a second pass: this runs on every
    request, for its fingerprint and for its merge key."""
    fields = {}
    for name, value in body.items():
        if name in skip:
            continue
        if type(value) not in _PLAIN:
            value = canonical_value(value)
        if value is not None:
            fields[name] = value
    return fields


def embedding_fingerprint(
    model: str, text: str, *, dimensions: int | None, cache_version: str, lowercase: bool = False,
    scope: str | None = None,
) -> str:
    """Return the hex SHA-256 key of one embedding input (whitespace-normalised text).

    `scope` (e.g. a tenant) keeps equal texts of different scopes apart; None, the default, shares
    keys across everyone and leaves them as they were before scopes existed.
    """
    canonical = {
        "kind": "embedding",
        "model": model,
        "text": normalize_text(text, lowercase=lowercase),
        "dimensions": dimensions,
        "cache_version": cache_version,
        "scope": scope,
    }
    return _digest(canonical)


def _canonical_message(message: Any, lowercase: bool, collapse_whitespace: bool) -> Any:
    if type(message) is not dict and not isinstance(message, Mapping):
        return canonical_value(message)
    # Every message field counts (role, name, tool-call state, vendor fields); only the text is normalised.
    out = {}
    for key, value in message.items():
        if type(value) not in _PLAIN:
            value = canonical_value(value)
        if value is not None:
            out[key if type(key) is str else str(key)] = value
    content = message.get("content")
    if type(content) is str:
        out["content"] = normalize_text(content, lowercase=lowercase, collapse_whitespace=collapse_whitespace)
        return out
    content = _canonical_content(content, partial(normalize_text, lowercase=lowercase,
                                                  collapse_whitespace=collapse_whitespace))
    if content is None:
        out.pop("content", None)
    else:
        out["content"] = content
    return out


def _canonical_content(content: Any, text: Callable[[str], str]) -> Any:
    if isinstance(content, str):
        return text(content)
    if isinstance(content, list):
        return [_canonical_part(part, text) for part in content]
    return canonical_value(content)


def _canonical_part(part: Any, text: Callable[[str], str]) -> Any:
    if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return {**canonical_value(part), "text": text(part["text"])}
    return canonical_value(part)


def canonical_stop(stop: Any) -> Any:
    """Canonical form of a `stop` field: "x" and ["x"] stop alike, and order does not matter."""
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return sorted(set(stop)) or None
    return canonical_value(stop)


_PLAIN = frozenset({str, int, bool, type(None)})  # what `canonical_value` gives back as it is


def canonical_value(value: Any) -> Any:
    """Make JSON-equal values serialise equally: drop nulls in objects, write integral floats as ints."""
    if type(value) in _PLAIN:  # what request bodies are mostly made of, answered before the general checks
        return value
    if isinstance(value, bool) or value is None or isinstance(value, (str, int)):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else value
    if isinstance(value, Mapping):
        return _drop_nulls({str(k): canonical_value(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return [canonical_value(v) for v in value]
    return str(value)


def _drop_nulls(mapping: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in mapping.items() if v is not None}


_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)
"""`json.dumps` with these options, built once: `dumps` builds a new encoder on every call with options."""


def _digest(canonical: dict[str, Any]) -> str:
    return json_digest(_drop_nulls(canonical))


def json_digest(canonical: dict[str, Any]) -> str:
    """SHA-256 of the canonical JSON: keys sorted, compact, UTF-8. orjson writes it about 15 times faster; what
    it refuses (an integer beyond 64 bits, a lone surrogate) the standard library writes. Either text parses
    back to the same value, so two different values never share a payload."""
    try:
        payload = orjson.dumps(canonical, option=orjson.OPT_SORT_KEYS)
    except TypeError:
        payload = _ENCODER.encode(canonical).encode("utf-8", "surrogatepass")
    return hashlib.sha256(payload).hexdigest()
