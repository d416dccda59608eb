"""What the simulator's Anthropic mode accepts: the Messages API's request types, and the rules of a strict upstream.

Every body is validated against the request types of the official `anthropic` SDK (its
`MessageCreateParams` TypedDicts, through pydantic, with unknown fields refused at every level as the API
does), so a translation the real API would refuse fails the test that sent it, not a user. The SDK is
a development dependency: without it only the rules below apply. The sampling fields the SDK's types
no longer list (`temperature`, `top_p`, `top_k`) are checked by hand. A beta call (`?beta=true`, as the SDK's
`client.beta` and Claude Code send it, or an `anthropic-beta` header) is checked against the SDK's beta types,
which take the beta fields (`context_management`, tools with `defer_loading`, ...); `count_tokens` bodies against
its count-tokens types. A `role: "system"` turn after the first user turn (as Claude Code sends reminders) is
taken, and left out of the turn rules.

On top, the rules of the strictest Messages upstreams, which the broker's translation must meet: turns
alternate and start with the user; text blocks are not empty; a final assistant turn does not end in
whitespace; stop sequences hold a visible character; each `tool_result` answers a `tool_use` of the
assistant turn just before and comes first in its user turn, and every `tool_use` is answered there;
a base64 image decodes to the media type it declares.
"""

from __future__ import annotations

import base64
import binascii
import copy
import functools
import importlib
from collections.abc import Mapping, Sequence
from typing import Any, cast

from mergebroker.providers.simulator.faults import is_int

_SAMPLING = ("temperature", "top_p", "top_k")
_FALLBACK_FIELDS = frozenset({"model", "messages", "max_tokens", "system", "stop_sequences", "metadata", "tools",
                              "tool_choice", "output_config", "thinking", "service_tier", "context_management"})
"""The top-level fields taken when the SDK's types are not installed to say so."""
_SIGNATURES = {"image/png": b"\x89PNG", "image/jpeg": b"\xff\xd8", "image/gif": b"GIF8", "image/webp": b"RIFF"}


class AnthropicRequestError(Exception):
    """A request the Messages API would refuse: its status and message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def validate(headers: Mapping[str, str], body: Any, *, beta: bool = False, count: bool = False) -> dict[str, Any]:
    """The request's body if the Messages API would take it, else `AnthropicRequestError` (status, message).
    `beta`: check against the beta types; `count`: a `count_tokens` body (no `max_tokens`)."""
    if not headers.get("x-api-key") and not headers.get("Authorization", "").startswith("Bearer "):
        raise AnthropicRequestError(401, "x-api-key header is required")
    if not headers.get("anthropic-version"):
        raise AnthropicRequestError(400, "anthropic-version: header is required")
    if not isinstance(body, dict):
        raise AnthropicRequestError(400, "The request body is not valid JSON.")
    _check_number(body, "temperature", 1)
    _check_number(body, "top_p", 1)
    if body.get("top_k") is not None and not (is_int(body["top_k"]) and body["top_k"] >= 0):
        raise AnthropicRequestError(400, "top_k: Input should be a non-negative integer")
    checked = {**body, "messages": conversation_turns(body.get("messages"))}
    problem = _sdk_problem({k: v for k, v in checked.items() if k not in (*_SAMPLING, "stream")}, beta=beta,
                           count=count)
    if problem:
        raise AnthropicRequestError(400, problem)
    _check_shape(checked, count=count)
    _check_turns(checked["messages"])
    breakpoints = _cache_controls(body)
    if breakpoints > MAX_BREAKPOINTS:
        raise AnthropicRequestError(400, f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be "
                                         f"provided. Found {breakpoints}.")
    stops = body.get("stop_sequences") or []
    if not all(isinstance(s, str) and s.strip() for s in stops):
        raise AnthropicRequestError(400, "stop_sequences: each stop sequence must contain non-whitespace")
    return body


MAX_BREAKPOINTS = 4


def _cache_controls(value: Any) -> int:
    """How many blocks of the body (tools, system, messages) carry `cache_control`. (The broker's Anthropic
    provider counts them too; the simulator imports none of the broker's code, so it counts on its own.)"""
    if isinstance(value, dict):
        return int("cache_control" in value) + sum(_cache_controls(v) for k, v in value.items() if k != "cache_control")
    if isinstance(value, list):
        return sum(_cache_controls(v) for v in value)
    return 0


def _check_number(body: Mapping[str, Any], name: str, high: float) -> None:
    value = body.get(name)
    if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                  and 0 <= value <= high):
        raise AnthropicRequestError(400, f"{name}: Input should be between 0 and {high:g}")


def conversation_turns(messages: Any) -> Any:
    """The messages the turn rules apply to: a `role: "system"` turn after a user turn is left out (its blocks are
    still checked); one before any user turn stays, to be refused."""
    if not isinstance(messages, list):
        return messages
    turns: list[Any] = []
    for i, message in enumerate(messages):
        if isinstance(message, dict) and message.get("role") == "system" and any(
                isinstance(m, dict) and m.get("role") == "user" for m in turns):
            _check_blocks(message.get("content"), f"messages.{i}.content")
            continue
        turns.append(message)
    return turns


def _check_shape(body: Mapping[str, Any], *, count: bool = False) -> None:
    """The essentials, for when the SDK's types are not there to check them."""
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise AnthropicRequestError(400, "model: Field required")
    if not count and (not is_int(body.get("max_tokens")) or body["max_tokens"] < 1):
        raise AnthropicRequestError(400, "max_tokens: Field required (an integer >= 1)")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise AnthropicRequestError(400, "messages: at least one message is required")
    if body.get("system") is not None:
        _check_blocks(body["system"], "system")


def _check_turns(messages: list[Any]) -> None:
    expected_results: set[str] = set()
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role != ("user" if i % 2 == 0 else "assistant"):
            raise AnthropicRequestError(400, f"messages.{i}.role: roles must alternate, starting with 'user'")
        blocks = _check_blocks(m.get("content"), f"messages.{i}.content")
        results = [b.get("tool_use_id") for b in blocks if b.get("type") == "tool_result"]
        if results != [b.get("tool_use_id") for b in blocks[:len(results)]] or set(results) != expected_results:
            raise AnthropicRequestError(400, f"messages.{i}.content: each tool_use needs its tool_result first in "
                                             "the next user turn, and each tool_result a tool_use before it")
        expected_results = {b["id"] for b in blocks if b.get("type") == "tool_use"}
    last = messages[-1]
    if last["role"] == "assistant" and _text_of(last["content"]) != _text_of(last["content"]).rstrip():
        raise AnthropicRequestError(400, "final assistant content cannot end with trailing whitespace")


def _check_blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if not isinstance(content, list) or not content:
        raise AnthropicRequestError(400, f"{where}: Input should be a valid string or a non-empty list")
    for j, block in enumerate(content):
        if not isinstance(block, dict):
            raise AnthropicRequestError(400, f"{where}.{j}: Input should be an object")
        if block.get("type") == "text" and not (isinstance(block.get("text"), str) and block["text"]):
            raise AnthropicRequestError(400, f"{where}.{j}.text: text content blocks must be non-empty")
        source = block.get("source") if block.get("type") == "image" else None
        if isinstance(source, dict) and source.get("type") == "base64":
            _check_image(source, f"{where}.{j}.source")
    return content


def _check_image(source: Mapping[str, Any], where: str) -> None:
    try:
        raw = base64.b64decode(str(source.get("data")), validate=True)
    except (binascii.Error, ValueError):
        raise AnthropicRequestError(400, f"{where}.data: invalid base64 data") from None
    if not raw.startswith(_SIGNATURES.get(str(source.get("media_type")), b"\x00\x00\x00\x00\x00")):
        raise AnthropicRequestError(400, f"{where}: Image does not match the provided media type "
                                         f"{source.get('media_type')}")


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(b.get("text") or "" for b in content if isinstance(b, dict) and b.get("type") == "text")


def _sdk_problem(body: dict[str, Any], *, beta: bool, count: bool) -> str | None:
    """The first thing the SDK's request types refuse in `body` ("path: message"), or None. Without the SDK,
    only unknown top-level fields are found."""
    validator = _sdk_validator(beta, count)
    if validator is None:
        extra = sorted(set(body) - _FALLBACK_FIELDS)
        return f"{extra[0]}: Extra inputs are not permitted" if extra else None
    from pydantic_core import ValidationError

    try:
        validator.validate_python(body)
    except ValidationError as exc:
        return _first_error(exc.errors(), body)
    return None


_PARAMS = {(False, False): ("anthropic.types.message_create_params", "MessageCreateParamsNonStreaming"),
           (True, False): ("anthropic.types.beta.message_create_params", "MessageCreateParamsNonStreaming"),
           (False, True): ("anthropic.types.message_count_tokens_params", "MessageCountTokensParams"),
           (True, True): ("anthropic.types.beta.message_count_tokens_params", "MessageCountTokensParams")}


@functools.cache
def _sdk_validator(beta: bool = False, count: bool = False) -> Any:
    """A validator of the SDK's request type (create or count tokens, beta or not), or None without the SDK."""
    module, name = _PARAMS[beta, count]
    try:
        params = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    from pydantic import TypeAdapter
    from pydantic_core import SchemaValidator

    # A core schema is a TypedDict: a plain dict at run time.
    return SchemaValidator(_strict(cast(dict[str, Any], TypeAdapter(params).core_schema)))


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """The SDK's request schema, checked as the API checks it rather than as a lenient SDK type.

    Its `Iterable` fields are validated lazily by pydantic (a generator nobody drains): they become lists.
    Its TypedDicts ignore unknown keys: they refuse them (unless the SDK allows extras there). Its unions
    also admit the SDK's response models (lenient): those choices go. A union whose choices all name
    their `type` (or `role`) becomes a tagged union, so an error names the block it is about.
    """
    schema = copy.deepcopy(schema)
    definitions = {d["ref"]: d for d in schema.get("definitions", [])}

    def resolve(node: dict[str, Any]) -> dict[str, Any]:
        while node.get("type") == "definition-ref":
            node = definitions[node["schema_ref"]]
        return node

    def is_model(node: dict[str, Any]) -> bool:
        node = resolve(node)
        return node.get("type") == "model" or (node.get("type") == "union"
                                               and all(is_model(_choice(c)) for c in node["choices"]))

    def visit(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                visit(item)
            return
        if not isinstance(node, dict):
            return
        kind = node.get("type")
        if kind == "generator":
            node["type"] = "list"
        elif (kind == "typed-dict" and (node.get("config") or {}).get("extra_fields_behavior") != "allow"
              and "extras_schema" not in node):  # a TypedDict that types its extra items takes them
            node["extra_behavior"] = "forbid"
        elif kind == "union":
            kept = [c for c in node["choices"] if not is_model(_choice(c))]
            node["choices"] = kept or node["choices"]
            tagged = _tagged(node["choices"], resolve)
            if tagged is not None:
                node.clear()
                node.update(tagged)
        for value in list(node.values()):
            visit(value)

    visit(schema)
    return schema


def _choice(choice: Any) -> dict[str, Any]:
    return choice[0] if isinstance(choice, (tuple, list)) else choice


def _tagged(choices: list[Any], resolve: Any) -> dict[str, Any] | None:
    """A tagged union over `choices` when each is a TypedDict with a required literal `type` (or `role`)."""
    for key in ("type", "role"):
        tags: dict[Any, Any] = {}
        for choice in choices:
            node = resolve(_choice(choice))
            field = node.get("fields", {}).get(key) if node.get("type") == "typed-dict" else None
            if not field or not field.get("required", True) or field["schema"].get("type") != "literal":
                break
            tags.update({value: _choice(choice) for value in field["schema"]["expected"]})
        else:
            return {"type": "tagged-union", "choices": tags, "discriminator": key}
    return None


def _first_error(errors: Sequence[Mapping[str, Any]], body: Any) -> str:
    """One readable "path: message" for the errors pydantic gives (the branch of a union with the fewest)."""
    def path(error: Mapping[str, Any]) -> tuple[list[str], str | None]:
        shown, labels, node = [], [], body
        last = len(error["loc"]) - 1
        for at, part in enumerate(error["loc"]):
            if isinstance(node, dict) and at != last and part in (node.get("type"), node.get("role")):
                continue  # a tagged union's tag
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and isinstance(part, int) and part < len(node):
                node = node[part]
            elif at != last:
                labels.append(str(part))  # a union branch, not a place in the body
                continue
            shown.append(str(part))
        return shown, labels[0] if labels else None

    branches: dict[str | None, int] = {}
    for error in errors:
        branch = path(error)[1]
        branches[branch] = branches.get(branch, 0) + 1
    best = min(errors, key=lambda e: (branches[path(e)[1]], -len(e["loc"])))
    return f"{'.'.join(path(best)[0])}: {best['msg']}"
