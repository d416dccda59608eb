"""Which chat requests may be merged, and which of them may share one merged call.

Only single-turn text requests merge: an optional system (or developer) message and exactly one user
message with non-empty text, no tools, no structured output, no logprobs, one choice, no streaming and
no audio or images. Everything else goes upstream on its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mergebroker.merge.fingerprint import canonical_fields, canonical_stop, json_digest

# Body fields whose presence (non-null, non-false) makes a request unmergeable.
_BLOCKING_FIELDS = (
    "tools", "functions", "tool_choice", "function_call", "response_format", "logprobs",
    "top_logprobs", "stream", "audio", "prediction",
)
_SYSTEM_ROLES = ("system", "developer")
_MESSAGE_FIELDS = frozenset({"role", "content", "name"})

# One merged call carries one value of every body field but these, so requests must agree on all the
# rest, known or not (model, sampling knobs, stop, `top_k`, `service_tier`, vendor fields...). These
# differ per member: each member's own question and token budget are in the combined prompt, `user`
# is not forwarded for a merged call, and `stream`/`broker` never reach it. Fields that only decide
# what the upstream keeps (`store`, `metadata`, `safety_identifier`) stay in the key: one member's
# choice must never apply to another's text.
_PER_MEMBER_FIELDS = frozenset({"messages", "max_tokens", "max_completion_tokens", "user", "stream",
                                "stream_options", "broker"})
# Fields `merge_shape` has already required to be unset or at their default: an explicit default
# (`"n": 1`, `"logprobs": false`) says nothing, so it must not keep two requests apart.
_VETTED_FIELDS = frozenset(_BLOCKING_FIELDS) | {"n", "modalities"}
_NOT_IN_KEY = _PER_MEMBER_FIELDS | _VETTED_FIELDS | {"stop"}  # stop is canonicalised apart


@dataclass(frozen=True)
class MergeShape:
    """The parts of a mergeable request the merge engine needs: its system prompt and its question."""

    system_prompt: str | None
    user_text: str


def merge_shape(body: Mapping[str, Any]) -> MergeShape | None:
    """Return the request's `MergeShape` when it is a single-turn text request, else None."""
    # Asked of every mergeable request, most of which name none of the blocking fields: one check in C.
    if not body.keys().isdisjoint(_BLOCKING_FIELDS):
        for field in _BLOCKING_FIELDS:
            if _is_set(body.get(field)):
                return None
    if body.get("n") not in (None, 1):
        return None
    if body.get("modalities") not in (None, ["text"]):
        return None
    messages = body.get("messages")
    if not isinstance(messages, list) or not 1 <= len(messages) <= 2:
        return None
    for message in messages:  # most messages are dicts of role and content: answered by one check in C
        if not (type(message) is dict and message.keys() <= _MESSAGE_FIELDS) and not _plain_message(message):
            return None
    *system, user = messages
    system_prompt = None
    if system:
        if system[0].get("role") not in _SYSTEM_ROLES:
            return None
        content = system[0].get("content")
        system_prompt = content if type(content) is str else _text_of(content)
        if system_prompt is None:
            return None
    if user.get("role") != "user":
        return None
    content = user.get("content")
    user_text = content if type(content) is str else _text_of(content)
    if user_text is None or not user_text.strip():
        return None
    return MergeShape(system_prompt=system_prompt, user_text=user_text)


def compatibility_key(
    body: Mapping[str, Any], shape: MergeShape, *, scope_value: str, include_system: bool = True
) -> str:
    """Hex hash that is equal for requests allowed to share one merged call.

    It covers `scope_value` (chosen by the caller: a tenant, tenant+user, a tier or "global"), every
    body field except the per-member ones (`_PER_MEMBER_FIELDS`), the stop sequences, and the exact
    system prompt unless `include_system=False` (the `system_prompts: tagged` mode, where each member
    carries its own).
    """
    stop = body.get("stop")
    canonical: dict[str, Any] = {"fields": canonical_fields(body, _NOT_IN_KEY), "scope": scope_value,
                                 "stop": None if stop is None else canonical_stop(stop)}
    if include_system:
        canonical["system"] = shape.system_prompt
    return json_digest(canonical)


def _plain_message(message: Any) -> bool:
    """True when the message is a mapping that carries nothing but role, content and name (tool turns, audio do
    not merge)."""
    if not isinstance(message, Mapping):
        return False
    if message.keys() <= _MESSAGE_FIELDS:  # most messages: answered by one check in C
        return True
    return all(value is None for key, value in message.items() if key not in _MESSAGE_FIELDS)


def _is_set(value: Any) -> bool:
    return value is not None and value is not False and value != [] and value != {}


def _text_of(content: Any) -> str | None:
    """The text of a string content or of a list of text parts only; None for anything else."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        return None
    texts = []
    for part in content:
        is_text = isinstance(part, Mapping) and part.get("type") == "text"
        if not is_text or not isinstance(part.get("text"), str):
            return None
        texts.append(part["text"])
    # Parts are joined with a newline so neighbouring parts cannot run their words together.
    return "\n".join(texts)
