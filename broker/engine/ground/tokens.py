"""Token estimates made before dispatch, close to what the provider will count.

Text is counted with the real o200k_base tokenizer (`bpe_openai`, offline, loaded once on first use).
If that package cannot be imported, or refuses a text (it will not encode 1M characters or more, nor
return more than about 200k tokens), counting falls back to `fallback_text_tokens`, a characters/4
estimate, for that text. Chat messages follow OpenAI's accounting rule for chat models: every message
costs 3 tokens of framing plus its role, content and name (a name costs 1 more), and the reply is
primed with 3 tokens. Parts that are not text have no text to count and get flat estimates. Long texts are
tokenized once and remembered (`token_memo`): agents send their whole conversation again on every turn.
"""

from __future__ import annotations

import json
import threading
import warnings
from array import array
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import structlog

from mergebroker.broker.engine.ground.token_memo import TokenMemo
from mergebroker.merge.member_budget import estimate_tokens

log = structlog.get_logger(__name__)

TOKENS_PER_MESSAGE = 3
TOKENS_PER_NAME = 1
REPLY_PRIMING_TOKENS = 3
IMAGE_TOKENS_LOW_DETAIL = 85
"""OpenAI's fixed price for an image sent with detail "low"."""
IMAGE_TOKENS_DEFAULT = 765
"""An image at "high"/"auto" detail is priced by its size, which is unknown here; 765 is the price of a
1024x1024 image, the common case."""
OTHER_PART_TOKENS = 85
"""Any other non-text part (audio, files): a flat guess, since its size is not visible in the body."""

_encode: Callable[[str], Sequence[int]] | None = None
_loaded = False
_load_lock = threading.Lock()
_MEMO = TokenMemo()
"""The ids of the long texts counted lately, shared by every count in this process."""


def _encoder() -> Callable[[str], Sequence[int]] | None:
    """The o200k_base encoder, or None when the tokenizer package is unavailable; loaded once."""
    global _encode, _loaded
    if _loaded:
        return _encode
    with _load_lock:  # counting may happen in worker threads; load the tables only once
        if not _loaded:
            try:
                with warnings.catch_warnings():  # its table loader uses a deprecated importlib call
                    warnings.simplefilter("ignore", DeprecationWarning)
                    import bpe_openai

                    encoding = bpe_openai.get_encoding("o200k_base")
                # encode_ordinary: user text that spells a special token is plain text to the provider.
                _encode = encoding.encode_ordinary
            except ImportError as exc:
                log.warning("tokenizer_unavailable", error=type(exc).__name__, fallback="chars_div_4")
                _encode = None
            _loaded = True
    return _encode


fallback_text_tokens = estimate_tokens
"""Estimate without a tokenizer: the one characters/4 rule (`merge.member_budget.estimate_tokens`), which the
merge engine's own cuts use too. Good to roughly a third on English prose; it undercounts scripts that take a
token per character."""


def count_text_tokens(text: str) -> int:
    """Tokens in `text` under o200k_base (or the fallback estimate when the tokenizer is missing)."""
    if not text:
        return 0
    ids = text_token_ids(text)
    return fallback_text_tokens(text) if ids is None else len(ids)


def text_token_ids(text: str) -> Sequence[int] | None:
    """The o200k_base ids of `text`, remembered for long texts (`token_memo`); None when the tokenizer is
    missing or refuses the text."""
    encode = _encoder()
    if encode is None:
        return None
    remembered = len(text) >= _MEMO.min_chars
    if remembered:
        known = _MEMO.get(text)
        if known is not None:
            return known
    try:
        ids = encode(text)
    except (ValueError, RuntimeError) as exc:  # its length guard, TokenLimitError (a ValueError), TokenizerError
        log.info("token_count_fallback", error=type(exc).__name__, chars=len(text))
        return None
    return _MEMO.put(text, ids) if remembered else ids


def _part_tokens(part: Any) -> int:
    """Tokens for one element of a content list."""
    if isinstance(part, str):
        return count_text_tokens(part)
    if not isinstance(part, Mapping):
        return 0
    kind = part.get("type")
    if kind in ("text", "input_text") or (kind is None and isinstance(part.get("text"), str)):
        return count_text_tokens(str(part.get("text") or ""))
    if kind == "image_url":
        image = part.get("image_url")
        detail = image.get("detail") if isinstance(image, Mapping) else None
        return IMAGE_TOKENS_LOW_DETAIL if detail == "low" else IMAGE_TOKENS_DEFAULT
    return OTHER_PART_TOKENS


def _content_tokens(content: Any) -> int:
    """Tokens for a message's `content`: a string, a list of parts, or nothing."""
    if content is None:
        return 0
    if isinstance(content, str):
        return count_text_tokens(content)
    if isinstance(content, Sequence):
        return sum(_part_tokens(part) for part in content)
    return 0


def _tool_call_tokens(tool_calls: Any) -> int:
    """Tokens for an assistant message's tool calls: the function names and argument text."""
    if not isinstance(tool_calls, Sequence) or isinstance(tool_calls, str):
        return 0
    total = 0
    for call in tool_calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(function, Mapping):
            arguments = function.get("arguments")
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments)
            total += count_text_tokens(str(function.get("name") or "")) + count_text_tokens(arguments)
    return total


_ROLE_TOKENS: dict[str, int] = {}
_ROLES_KEPT = 64  # roles come from a handful of names; a caller inventing more is simply counted each time


def _role_tokens(role: str) -> int:
    """`count_text_tokens(role)`, remembered: every message names one of a few roles."""
    found = _ROLE_TOKENS.get(role)
    if found is None:
        found = count_text_tokens(role)
        if len(_ROLE_TOKENS) < _ROLES_KEPT:
            _ROLE_TOKENS[role] = found
    return found


def estimate_prompt_tokens(messages: Sequence[Mapping[str, Any]]) -> int:
    """Prompt tokens of a chat request: 3 per message plus its role, content and name, plus 3 priming."""
    total = REPLY_PRIMING_TOKENS + TOKENS_PER_MESSAGE * len(messages)
    for message in messages:  # asked of most requests: the common message (a known role, text) goes first
        role = message.get("role")
        total += (type(role) is str and _ROLE_TOKENS.get(role)) or _role_tokens(str(role or ""))
        content = message.get("content")
        total += count_text_tokens(content) if type(content) is str else _content_tokens(content)
        name = message.get("name")
        if isinstance(name, str) and name:
            total += count_text_tokens(name) + TOKENS_PER_NAME
        tool_calls = message.get("tool_calls")
        if tool_calls:
            total += _tool_call_tokens(tool_calls)
    return total


def estimate_embedding_tokens(inputs: str | Sequence[Any]) -> int:
    """Tokens of an embeddings `input`: a string, a list of strings, a token array, or a list of them.

    Token arrays are already tokens, so they count by length; embeddings add no per-input framing.
    """
    if isinstance(inputs, str):
        return count_text_tokens(inputs)
    if not inputs:
        return 0
    if all(isinstance(item, int) for item in inputs):
        return len(inputs)
    total = 0
    for item in inputs:
        if isinstance(item, str):
            total += count_text_tokens(item)
        elif isinstance(item, Sequence):
            total += len(item)
    return total


def prompt_token_ids(messages: Sequence[Mapping[str, Any]]) -> Sequence[int]:
    """The prompt as one token sequence, message by message in order (its role, then its text): what a provider's
    prefix cache sees, in the broker's tokens. Each text is tokenized on its own, so a message's tokens do not
    depend on its neighbours and a conversation's earlier turns are remembered (`token_memo`). Without the
    tokenizer, 4-character chunks stand in for tokens."""
    ids: array[int] = array("I")
    for message in messages:
        for text in (f"\x00{message.get('role') or ''}\x00", _content_text(message.get("content"))):
            if text:
                found = text_token_ids(text)
                ids.extend([hash(text[i:i + 4]) & 0x7FFFFFFF for i in range(0, len(text), 4)] if found is None
                           else found)
    return ids


def prompt_token_bound(messages: Sequence[Mapping[str, Any]]) -> int:
    """At least the length of `prompt_token_ids(messages)`, without tokenizing: each token is at least one byte
    of UTF-8 (a character is one byte in ASCII, at most four otherwise), and each stand-in chunk four characters."""
    total = 0
    for message in messages:
        content = message.get("content")
        text = f"\x00{message.get('role') or ''}\x00" + (content if type(content) is str else _content_text(content))
        total += len(text) if text.isascii() else 4 * len(text)
    return total


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text") or "") for p in content if isinstance(p, dict))
    return ""
