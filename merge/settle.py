"""Settle a merged reply: each member's own `chat.completion`, or the reason it must be re-sent alone.

Pure: the live dispatcher (`broker.dispatch`) and the bulk runner (`broker.batch_runner`) both call
`settle_merged` and act on its `Settlement`. The reply is split by ID (`merge.split`), answers that quote
another member's request are discarded (`merge.leak`), and the call's usage is apportioned to the members
with a good answer and the ones re-sent alike (`merge.usage`), so per-member accounting adds up.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Mapping

from mergebroker.merge.leak import find_leaks
from mergebroker.merge.split import split_reply
from mergebroker.merge.usage import apportion_usage


@dataclass(frozen=True)
class SettleMember:
    """What settling needs about one member: the text leak checks protect and its own prompt tokens."""

    request_text: str  # the user text (in tagged mode: the member's system prompt and user text)
    own_prompt_tokens: int


@dataclass(frozen=True)
class Settlement:
    """The outcome of one merged reply: completions by member ID, and the members to re-send alone."""

    answers: dict[str, dict[str, Any]]
    failed: dict[str, str]  # member ID -> reason ("missing", "malformed", "leak", ...)


def settle_merged(reply: dict[str, Any], members: Mapping[str, SettleMember], *, leak_min_words: int,
                  stop: str | list[str] | None) -> Settlement | None:
    """Split `reply` among `members` (keyed by their batch IDs); None when the reply is unusable as a whole."""
    read = reply_text(reply)
    if read is None:
        return None
    content, finish_reason = read
    answers = split_reply(content, list(members), finish_reason=finish_reason)
    good = {i: a for i, a in answers.items() if isinstance(a, str)}
    questions = {i: m.request_text for i, m in members.items()}
    failed: dict[str, str] = {i: a.value for i, a in answers.items() if not isinstance(a, str)}
    for leaked in find_leaks(good, questions, min_words=leak_min_words):
        failed[leaked] = "leak"
        good.pop(leaked)
    usage = _apportion(reply, members, good)
    completions = {i: member_completion(reply, apply_stop(text, stop), usage[i]) for i, text in good.items()}
    return Settlement(completions, failed)


def leak_protected_text(system_prompt: str | None, user_text: str, tagged_system: bool) -> str:
    """What a member's leak check protects: its user text and, with tagged system prompts (each member's own
    system prompt travels in the call too), its system prompt."""
    if tagged_system and system_prompt:
        return system_prompt + "\n" + user_text
    return user_text


def _apportion(reply: dict[str, Any], members: Mapping[str, SettleMember], good: dict[str, str]) -> dict[str, dict]:
    usage = reply.get("usage")
    usage = usage if isinstance(usage, dict) else {}
    prompt, completion = token_count(usage.get("prompt_tokens")), token_count(usage.get("completion_tokens"))
    own = {i: m.own_prompt_tokens for i, m in members.items()}
    return apportion_usage(
        {"prompt_tokens": prompt, "completion_tokens": completion},
        shared_prompt_tokens=max(0, prompt - sum(own.values())),
        member_prompt_tokens=own,
        member_completion_weights={i: max(1, len(good.get(i, ""))) for i in members},
    )


def reply_text(reply: Any) -> tuple[str, str | None] | None:
    """The first choice's text and finish reason of a merged reply, or None when the reply is unusable."""
    choices = reply.get("choices") if isinstance(reply, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices else None
    message = choice.get("message") if isinstance(choice, dict) else None
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, str):
        return None
    finish_reason = choice.get("finish_reason")  # type: ignore[union-attr]
    return content, finish_reason if isinstance(finish_reason, str) else None


def token_count(value: Any) -> int:
    """A token count from an upstream's usage object; anything but a non-negative number counts as 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        return 0
    return int(value)


def apply_stop(text: str, stop: str | list[str] | None) -> str:
    """Cut a member's answer at its first stop sequence, as the upstream would have."""
    sequences = [stop] if isinstance(stop, str) else list(stop or [])
    cut = min((i for i in (text.find(s) for s in sequences if s) if i >= 0), default=len(text))
    return text[:cut]


def member_completion(reply: dict[str, Any], text: str, usage: dict[str, int]) -> dict[str, Any]:
    """A complete `chat.completion` of a member's own, cut out of a merged reply."""
    return {
        "id": "chatcmpl-" + uuid.uuid4().hex[:24],
        "object": "chat.completion",
        "created": reply.get("created", int(time.time())),
        "model": reply.get("model"),
        "system_fingerprint": reply.get("system_fingerprint"),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                     "finish_reason": "stop"}],
        "usage": usage,
    }
