"""A `POST /v1/batches` body, checked as OpenAI checks it (pure).

`metadata` follows OpenAI's limits: at most 16 pairs, keys of at most 64 characters, string values of at
most 512.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mergebroker.errors import InvalidRequest

WINDOWS_S = {"24h": 24 * 3600}
ENDPOINT = "/v1/chat/completions"
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


@dataclass(frozen=True)
class CreateRequest:
    """What a valid create body asks for."""

    input_file_id: str
    endpoint: str
    window: str
    metadata: dict[str, str] | None


def check_create(body: Any) -> CreateRequest:
    """The request in `body`, or the `InvalidRequest` naming the first bad parameter."""
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_body")
    endpoint, window = body.get("endpoint"), body.get("completion_window")
    if endpoint != ENDPOINT:
        raise InvalidRequest(f"Unsupported endpoint {str(endpoint)[:80]!r}: use {ENDPOINT!r}.", param="endpoint",
                             code="unsupported_endpoint")
    if window not in WINDOWS_S:
        raise InvalidRequest(f"Unsupported completion_window {str(window)[:40]!r}: use '24h'.",
                             param="completion_window")
    file_id = body.get("input_file_id")
    if not isinstance(file_id, str) or not file_id:
        raise InvalidRequest("Missing required parameter: 'input_file_id'.", param="input_file_id")
    return CreateRequest(file_id, endpoint, window, check_metadata(body.get("metadata")))


def check_metadata(metadata: Any) -> dict[str, str] | None:
    """`metadata` within OpenAI's limits, or a 400 saying which one it passes."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise _bad_metadata("'metadata' must be an object of string keys and string values.")
    if len(metadata) > MAX_METADATA_PAIRS:
        raise _bad_metadata(f"'metadata' may hold at most {MAX_METADATA_PAIRS} key-value pairs.")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise _bad_metadata(f"'metadata' keys may be at most {MAX_METADATA_KEY_CHARS} characters long.")
        if not isinstance(value, str):
            raise _bad_metadata("'metadata' values must be strings.")
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise _bad_metadata(f"'metadata' values may be at most {MAX_METADATA_VALUE_CHARS} characters long.")
    return dict(metadata)


def _bad_metadata(message: str) -> InvalidRequest:
    return InvalidRequest(message, param="metadata", code="invalid_metadata")
