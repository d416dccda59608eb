"""The `messages` and `system` of a Messages body: checked block by block (pure).

A malformed shape gets its 400 here, naming the field in Anthropic's dotted form (`messages.2.content.0.text`),
so nothing later (translation, counting, the native upstream) meets a block it cannot read. Blocks of a
known type beyond what the translation reads (server tool results, search results, container uploads) are
only checked for their `type`; the native path forwards them as they came.
"""

from __future__ import annotations

from typing import Any

from mergebroker.errors import InvalidRequest

BLOCK_TYPES = frozenset(("text", "image", "document", "tool_use", "tool_result", "thinking", "redacted_thinking",
                         "server_tool_use", "web_search_tool_result", "search_result", "container_upload"))
ROLES = ("user", "assistant")
# A block of these types belongs to one role only: chat has a place for it on that side alone.
_ROLE_OF = {"tool_use": "assistant", "tool_result": "user"}
_SOURCE_TYPES = ("base64", "url", "text", "content", "file")
_MEDIA_TYPES = {"image": ("image/jpeg", "image/png", "image/gif", "image/webp"),
                "document": ("application/pdf", "text/plain")}
"""The media types Anthropic takes in a base64 source, per block type."""


def check_messages(messages: Any) -> tuple[dict[str, Any], ...]:
    """The checked `messages`: a non-empty array of user/assistant messages of string or block content."""
    if messages is None:
        raise _missing("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages: a non-empty array of messages is required", param="messages",
                             code="invalid_type")
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(message, dict):
            raise InvalidRequest(f"{where}: a message must be an object", param=where, code="invalid_type")
        if message.get("role") not in ROLES:
            raise InvalidRequest(f"{where}.role: must be 'user' or 'assistant'", param=f"{where}.role",
                                 code="invalid_value")
        check_content(message.get("content"), f"{where}.content", role=message["role"])
    _check_tool_pairs(messages)
    return tuple(messages)


def _check_tool_pairs(messages: list[dict[str, Any]]) -> None:
    """Every `tool_result` answers a `tool_use` of the assistant turn just before it (as Anthropic requires;
    chat, too, needs each tool message to follow its call)."""
    for i, message in enumerate(messages):
        if message["role"] != "user" or not isinstance(message["content"], list):
            continue
        previous = messages[i - 1]["content"] if i > 0 else []
        calls = {b.get("id") for b in previous if isinstance(b, dict) and b.get("type") == "tool_use"} \
            if isinstance(previous, list) else set()
        for j, block in enumerate(message["content"]):
            if block.get("type") == "tool_result" and block["tool_use_id"] not in calls:
                where = f"messages.{i}.content.{j}.tool_use_id"
                raise InvalidRequest(f"{where}: unexpected tool_use_id {block['tool_use_id']!r}: each tool_result "
                                     "must answer a tool_use in the assistant message just before it",
                                     param=where, code="invalid_value")


def check_content(content: Any, where: str, *, role: str) -> None:
    """A message's `content`: a string, or an array of blocks each of a known type."""
    if isinstance(content, str):
        return
    if content is None:
        raise _missing(where)
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}: must be a string or an array of content blocks", param=where,
                             code="invalid_type")
    for j, block in enumerate(content):
        check_block(block, f"{where}.{j}", role=role)


def check_block(block: Any, where: str, *, role: str) -> None:
    """One content block: its `type` known, and the fields the translation reads of the right shape."""
    if not isinstance(block, dict):
        raise InvalidRequest(f"{where}: a content block must be an object", param=where, code="invalid_type")
    kind = block.get("type")
    if kind not in BLOCK_TYPES:
        raise InvalidRequest(f"{where}.type: unknown content block type {kind!r}", param=f"{where}.type",
                             code="invalid_value")
    if _ROLE_OF.get(kind, role) != role:
        raise InvalidRequest(f"{where}: a {kind} block may only appear in a {_ROLE_OF[kind]} message",
                             param=where, code="invalid_value")
    if kind == "text":
        _require(block, "text", str, where, "a string")
        if not block["text"]:
            raise InvalidRequest(f"{where}.text: text content blocks must be non-empty", param=f"{where}.text",
                                 code="invalid_value")
    elif kind == "tool_use":
        _require(block, "id", str, where, "a string")
        _require(block, "name", str, where, "a string")
        _require(block, "input", dict, where, "an object")
    elif kind == "tool_result":
        _check_tool_result(block, where)
    elif kind in ("image", "document"):
        _check_source(block, where)


def check_system(system: Any) -> None:
    """`system`: absent, a string, or an array of text blocks."""
    if system is None or isinstance(system, str):
        return
    if not isinstance(system, list):
        raise InvalidRequest("system: must be a string or an array of text blocks", param="system",
                             code="invalid_type")
    for i, block in enumerate(system):
        where = f"system.{i}"
        if not isinstance(block, dict) or block.get("type") != "text":
            raise InvalidRequest(f"{where}: system blocks must be text blocks", param=where, code="invalid_value")
        _require(block, "text", str, where, "a string")


def system_text(system: str | list[dict[str, Any]] | None) -> str:
    """A checked `system` as one string, its blocks joined by a blank line."""
    if system is None or isinstance(system, str):
        return system or ""
    return "\n\n".join(block["text"] for block in system)


def block_types(messages: tuple[dict[str, Any], ...]) -> set[str]:
    """Every block type the checked messages use (string content counts as text)."""
    kinds: set[str] = set()
    for message in messages:
        content = message["content"]
        kinds.update(("text",) if isinstance(content, str) else (block["type"] for block in content))
    return kinds


def _check_tool_result(block: dict[str, Any], where: str) -> None:
    _require(block, "tool_use_id", str, where, "a string")
    content = block.get("content")
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}.content: must be a string or an array of content blocks",
                             param=f"{where}.content", code="invalid_type")
    for k, inner in enumerate(content):
        check_block(inner, f"{where}.content.{k}", role="user")


def _check_source(block: dict[str, Any], where: str) -> None:
    source = block.get("source")
    if not isinstance(source, dict) or source.get("type") not in _SOURCE_TYPES:
        raise InvalidRequest(f"{where}.source: an object whose type is one of {', '.join(_SOURCE_TYPES)} is required",
                             param=f"{where}.source", code="invalid_value")
    needed = {"base64": ("media_type", "data"), "url": ("url",), "text": ("data",)}.get(source["type"], ())
    for name in needed:
        _require(source, name, str, f"{where}.source", "a string")
    allowed = _MEDIA_TYPES[block["type"]]
    if source["type"] == "base64" and source["media_type"] not in allowed:
        raise InvalidRequest(f"{where}.source.media_type: {source['media_type']!r} is not one of "
                             f"{', '.join(allowed)}", param=f"{where}.source.media_type", code="invalid_value")


def _require(obj: dict[str, Any], name: str, kind: type, where: str, expected: str) -> None:
    value = obj.get(name)
    if value is None:
        raise _missing(f"{where}.{name}")
    if not isinstance(value, kind):
        raise InvalidRequest(f"{where}.{name}: must be {expected}", param=f"{where}.{name}", code="invalid_type")


def _missing(where: str) -> InvalidRequest:
    return InvalidRequest(f"{where}: Field required", param=where, code="missing_required_parameter")
