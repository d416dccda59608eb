"""OpenAI chat messages as Anthropic's `system` and strictly alternating turns (pure).

- System and developer messages, wherever they are, become `system` (joined in order): the Messages API
  has no system turns, and a mid-conversation instruction keeps its authority there.
- An assistant's `tool_calls` become `tool_use` blocks after its text; `role: "tool"` messages become
  `tool_result` blocks of the next user turn, consecutive results grouped and placed first, as the API
  requires. A result must answer a call of the assistant message before it, and every call needs one.
- Consecutive turns of one role are combined (so are those a removed system message leaves side by side),
  a conversation opening with an assistant turn gets a short user turn before it (`OPENING_USER_TURN`),
  and trailing whitespace leaves a final assistant turn (a prefill the API refuses with it).
"""

from __future__ import annotations

from typing import Any

from mergebroker.providers.anthropic.content import Blocks, compact, content_blocks, plain_text
from mergebroker.providers.anthropic.images import count_images
from mergebroker.providers.anthropic.refuse import refuse
from mergebroker.providers.anthropic.tools import tool_use_blocks

OPENING_USER_TURN = "(conversation start)"
"""The user turn placed before a conversation that opens with an assistant turn (the API needs a user first)."""

_FIELDS = {"system": {"content"}, "developer": {"content"}, "user": {"content"}, "tool": {"content", "tool_call_id"},
           "assistant": {"content", "tool_calls", "refusal"}}
"""What each role may carry besides `role` (a message `name`, audio or a legacy function call is refused)."""


def split_messages(messages: Any) -> tuple[list[str], list[dict[str, Any]]]:
    """System texts (system and developer messages, in order) and the alternating user/assistant turns."""
    if not isinstance(messages, list) or not messages:
        raise refuse("messages", "a non-empty list of messages is required")
    images = count_images(messages)
    system: list[str] = []
    turns: list[tuple[str, Blocks]] = []
    open_calls: dict[str, int] = {}  # tool_use id -> the assistant message that made it, until answered
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in _FIELDS:
            raise refuse(f"messages[{i}].role", f"role {role!r} is not translated")
        extra = sorted(k for k in m if k != "role" and k not in _FIELDS[role] and m[k] is not None)
        if extra:
            raise refuse(f"messages[{i}].{extra[0]}", f"a {role} message's {extra[0]} is not translated")
        if role != "tool" and open_calls:
            raise refuse(f"messages[{min(open_calls.values())}].tool_calls",
                         "every tool call needs a tool message answering it before the conversation goes on")
        if role in ("system", "developer"):
            system.append(plain_text(m.get("content"), f"messages[{i}].content"))
            continue
        if role == "tool":
            blocks = [_tool_result(m, i, open_calls)]
        elif role == "assistant":
            blocks = _assistant(m, i)
            open_calls = {b["id"]: i for b in blocks if b["type"] == "tool_use"}
        else:
            blocks = content_blocks(m.get("content"), f"messages[{i}].content", images=images)
        if not blocks:
            raise refuse(f"messages[{i}].content", "Anthropic refuses empty messages")
        _append(turns, "assistant" if role == "assistant" else "user", blocks)
    if not turns:
        raise refuse("messages", "Anthropic needs at least one user or assistant message")
    return system, _finished(turns)


def _assistant(m: dict[str, Any], i: int) -> Blocks:
    content = m.get("content")
    if content is None and isinstance(m.get("refusal"), str):
        content = m["refusal"]  # a refusal replayed from an earlier answer is what the assistant said
    blocks = content_blocks(content, f"messages[{i}].content") if content is not None else []
    if m.get("tool_calls"):
        blocks += tool_use_blocks(m["tool_calls"], f"messages[{i}].tool_calls")
    return blocks


def _tool_result(m: dict[str, Any], i: int, open_calls: dict[str, int]) -> dict[str, Any]:
    call_id = m.get("tool_call_id")
    if not isinstance(call_id, str) or call_id not in open_calls:
        raise refuse(f"messages[{i}].tool_call_id", "a tool message must answer a tool call of the assistant "
                                                    "message before it")
    del open_calls[call_id]
    block: dict[str, Any] = {"type": "tool_result", "tool_use_id": call_id}
    texts = content_blocks(m.get("content"), f"messages[{i}].content") if m.get("content") is not None else []
    if texts:
        block["content"] = compact(texts)
    return block


def _append(turns: list[tuple[str, Blocks]], role: str, blocks: Blocks) -> None:
    """Add a turn, combined with the previous one when it has the same role."""
    if turns and turns[-1][0] == role:
        turns[-1][1].extend(blocks)
    else:
        turns.append((role, list(blocks)))


def _finished(turns: list[tuple[str, Blocks]]) -> list[dict[str, Any]]:
    if turns[0][0] == "assistant":
        turns.insert(0, ("user", [{"type": "text", "text": OPENING_USER_TURN}]))
    role, blocks = turns[-1]
    if role == "assistant" and blocks[-1]["type"] == "text":
        text = blocks[-1]["text"].rstrip()
        blocks[-1] = {**blocks[-1], "text": text}
        if not text:
            blocks.pop()
        if not blocks:
            turns.pop()
    return [{"role": role, "content": compact(blocks)} for role, blocks in turns]
