"""A chat message's content as Anthropic content blocks (pure).

Text parts become text blocks and `image_url` parts image blocks (`providers.anthropic_images`); empty
texts are left out, since the Messages API refuses empty text blocks. Audio and file parts, and images
anywhere but in a user turn, are refused naming the part.
"""

from __future__ import annotations

from typing import Any

from mergebroker.providers.anthropic.images import image_block
from mergebroker.providers.anthropic.refuse import refuse

Blocks = list[dict[str, Any]]

_UNTRANSLATED_PARTS = {"input_audio": "audio input is not translated", "audio": "audio input is not translated",
                       "file": "file parts are not translated", "refusal": "refusal parts are not translated"}


def content_blocks(content: Any, where: str, *, images: int | None = None) -> Blocks:
    """The blocks of a message's `content` (a string or a list of parts) at `where`; `images` is the request's
    image count where images are allowed (user turns), None elsewhere. May be empty."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    if not isinstance(content, list) or not content:
        raise refuse(where, "each message needs text content")
    blocks: Blocks = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            blocks += [{"type": "text", "text": part["text"]}] if part["text"] else []
        elif kind == "image_url" and images is not None:
            blocks.append(image_block(part, f"{where}[{j}]", images=images))
        elif kind == "image_url":
            raise refuse(f"{where}[{j}].type", "images are translated in user messages only")
        else:
            raise refuse(f"{where}[{j}].type", _UNTRANSLATED_PARTS.get(str(kind), "only text and image parts "
                                                                                  "are translated"))
    return blocks


def plain_text(content: Any, where: str) -> str:
    """The text of a content that may only be text (system and developer messages), parts joined by newlines."""
    blocks = content_blocks(content, where)
    return "\n".join(b["text"] for b in blocks)


def compact(blocks: Blocks) -> str | Blocks:
    """A single text block as a plain string (the shorter form the API also takes), else the blocks."""
    if len(blocks) == 1 and set(blocks[0]) == {"type", "text"} and blocks[0]["type"] == "text":
        return blocks[0]["text"]
    return blocks
