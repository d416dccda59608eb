"""The broker's estimate of a count_tokens request's input tokens, for upstreams that cannot count (pure).

An estimate, not Anthropic's count: the text of `system`, of every text, tool call, tool result, thinking
and plain-text document block, and the JSON of the tool definitions, each through the caller's tokenizer,
plus a few tokens per message for the turn's framing and a flat allowance per image or PDF (Anthropic bills
an image by its size, at most about 1,600 tokens; a PDF by its pages, which are not read here).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from mergebroker.broker.engine.apis.messages.content import system_text
from mergebroker.broker.engine.apis.messages.request import MessagesRequest

PER_MESSAGE_TOKENS = 3
PER_IMAGE_TOKENS = 1600


def count_prompt(request: MessagesRequest, count_text: Callable[[str], int]) -> int:
    """The estimated input tokens of `request`, its text counted by `count_text`."""
    raw = request.body
    texts = [system_text(raw.get("system"))]
    texts += [json.dumps(tool, ensure_ascii=False) for tool in raw.get("tools") or ()]
    flat = 0
    for message in raw["messages"]:
        flat += PER_MESSAGE_TOKENS
        content = message["content"]
        for block in [{"type": "text", "text": content}] if isinstance(content, str) else content:
            flat += _block_texts(block, texts)
    return flat + sum(count_text(text) for text in texts if text)


def _block_texts(block: dict[str, Any], texts: list[str]) -> int:
    """Append a block's countable text to `texts`; return the flat tokens it adds besides."""
    kind = block["type"]
    if kind == "text":
        texts.append(block["text"])
    elif kind == "thinking" and isinstance(block.get("thinking"), str):
        texts.append(block["thinking"])
    elif kind == "tool_use":
        texts += [block["name"], json.dumps(block["input"], ensure_ascii=False)]
    elif kind == "tool_result":
        content = block.get("content")
        if isinstance(content, str):
            texts.append(content)
        return sum(_block_texts(inner, texts) for inner in content) if isinstance(content, list) else 0
    elif kind == "document" and (block.get("source") or {}).get("type") == "text":
        texts.append(block["source"]["data"])
    elif kind in ("image", "document"):
        return PER_IMAGE_TOKENS
    return 0
