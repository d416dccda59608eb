"""Messages turns as Chat Completions messages (pure).

A turn of text only becomes one string (its blocks joined by a blank line), so merged prompts stay simple;
images become `image_url` parts, a base64 PDF a `file` part, a plain-text document its text. An assistant
turn's `tool_use` blocks become its `tool_calls`; a user turn's `tool_result` blocks become `tool`
messages placed before the rest of that turn, since chat wants tool messages right after the assistant's
calls. Thinking cannot cross providers (its signature is only readable by the one that wrote it), and
Anthropic's server-side blocks have no chat form: both are dropped, each kind named once in `dropped`.
`cache_control` markers are not carried: chat upstreams cache prefixes by themselves.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

_THINKING = ("thinking", "redacted_thinking")
_ERROR_PREFIX = "Error: "


def chat_messages(messages: Iterable[dict[str, Any]], dropped: list[str]) -> list[dict[str, Any]]:
    """The chat messages for checked Messages turns, in order; what cannot cross is appended to `dropped`."""
    out: list[dict[str, Any]] = []
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            out.append({"role": message["role"], "content": content})
        elif message["role"] == "assistant":
            out.append(_assistant(content, dropped))
        else:
            out += _user(content, dropped)
    return out


def _assistant(blocks: list[dict[str, Any]], dropped: list[str]) -> dict[str, Any]:
    texts, calls = [], []
    for block in blocks:
        kind = block["type"]
        if kind == "text":
            texts.append(block["text"])
        elif kind == "tool_use":
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block["input"])}})
        else:
            dropped.append("thinking" if kind in _THINKING else kind)
    message: dict[str, Any] = {"role": "assistant", "content": "\n\n".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


def _user(blocks: list[dict[str, Any]], dropped: list[str]) -> list[dict[str, Any]]:
    """A user turn: its tool results as `tool` messages first, then one message with the rest (if any)."""
    results = [_tool_message(block, dropped) for block in blocks if block["type"] == "tool_result"]
    parts = [part for block in blocks if block["type"] != "tool_result"
             if (part := _part(block, dropped)) is not None]
    if not parts:
        return results
    if all(part["type"] == "text" for part in parts):
        return [*results, {"role": "user", "content": "\n\n".join(part["text"] for part in parts)}]
    return [*results, {"role": "user", "content": parts}]


def _tool_message(block: dict[str, Any], dropped: list[str]) -> dict[str, Any]:
    content = block.get("content")
    if isinstance(content, list):
        texts = []
        for inner in content:
            part = _part(inner, dropped)
            if part is not None and part["type"] == "text":
                texts.append(part["text"])
            elif part is not None:
                # A chat tool message holds text only; the image stays with the native path.
                dropped.append(f"tool_result.{inner['type']}")
        content = "\n\n".join(texts)
    text = content or ""
    if block.get("is_error") is True:
        text = _ERROR_PREFIX + text
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}


def _part(block: dict[str, Any], dropped: list[str]) -> dict[str, Any] | None:
    """The chat content part for one user block, or None (appended to `dropped`) when chat has none."""
    kind = block["type"]
    if kind == "text":
        return {"type": "text", "text": block["text"]}
    source = block.get("source") or {}
    if kind == "image" and source.get("type") == "base64":
        return {"type": "image_url", "image_url": {"url": f"data:{source['media_type']};base64,{source['data']}"}}
    if kind == "image" and source.get("type") == "url":
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    if kind == "document" and source.get("type") == "text":
        return {"type": "text", "text": source["data"]}
    if kind == "document" and source.get("type") == "base64":
        file = {"file_data": f"data:{source['media_type']};base64,{source['data']}",
                "filename": block.get("title") if isinstance(block.get("title"), str) else "document.pdf"}
        return {"type": "file", "file": file}
    if kind in ("image", "document"):
        dropped.append(f"{kind}.{source.get('type')}")
    else:
        dropped.append("thinking" if kind in _THINKING else kind)
    return None
