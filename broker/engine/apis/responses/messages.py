"""Responses input items as Chat Completions messages (pure).

Messages keep their role (`developer` becomes `system`); text parts become text, an assistant's as one
string; `input_image` becomes an `image_url` part and `input_file` a `file` part where chat can carry
them. Function calls join the assistant message before them as `tool_calls` (a namespaced call under its
flat chat name); their outputs become `tool` messages. Reasoning items cannot cross providers (their
`encrypted_content` is only readable by the one that wrote it), and hosted tools' items have no chat form:
both are dropped, each kind named once in `dropped`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from mergebroker.broker.engine.apis.responses.items import TEXT_PARTS, item_type
from mergebroker.broker.engine.apis.responses.tools import flat_name

_CHAT_DETAIL = ("auto", "low", "high")


def chat_messages(items: Iterable[dict[str, Any]], dropped: list[str]) -> list[dict[str, Any]]:
    """The chat messages for checked items, in order; what cannot cross is appended to `dropped`."""
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item_type(item)
        if kind == "message":
            messages.append(_message(item, dropped))
        elif kind == "function_call":
            _add_call(messages, item)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _output_text(item["output"], dropped)})
        else:
            dropped.append(f"input.{kind}")
    return messages


def _message(item: dict[str, Any], dropped: list[str]) -> dict[str, Any]:
    role = "system" if item["role"] == "developer" else item["role"]
    content = item["content"]
    if isinstance(content, str):
        return {"role": role, "content": content}
    if role == "assistant":
        return _assistant(content)
    parts = [chat for part in content if (chat := _part(part, dropped)) is not None]
    if all(part["type"] == "text" for part in parts) and (role == "system" or len(parts) == 1):
        # A string is what every chat provider takes; several user parts stay parts, as they were sent.
        return {"role": role, "content": "".join(part["text"] for part in parts)}
    return {"role": role, "content": parts}


def _assistant(content: list[dict[str, Any]]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant",
                               "content": "".join(p["text"] for p in content if p["type"] in TEXT_PARTS)}
    refusal = "".join(p.get("refusal") or "" for p in content if p["type"] == "refusal")
    if refusal:
        message["refusal"] = refusal
    return message


def _part(part: dict[str, Any], dropped: list[str]) -> dict[str, Any] | None:
    kind = part["type"]
    if kind in TEXT_PARTS:
        return {"type": "text", "text": part["text"]}
    if kind == "input_image":
        if not part.get("image_url"):
            dropped.append("input_image.file_id")
            return None
        image: dict[str, Any] = {"url": part["image_url"]}
        if part.get("detail") in _CHAT_DETAIL:
            image["detail"] = part["detail"]
        return {"type": "image_url", "image_url": image}
    file = {key: part[key] for key in ("file_data", "file_id", "filename") if part.get(key)}
    if not (file.get("file_data") or file.get("file_id")):
        dropped.append("input_file.file_url")
        return None
    return {"type": "file", "file": file}


def _add_call(messages: list[dict[str, Any]], item: dict[str, Any]) -> None:
    """A function call joins the assistant message just before it (its text, or its earlier calls)."""
    call = {"id": item["call_id"], "type": "function",
            "function": {"name": flat_name(item.get("namespace") or None, item["name"]),
                         "arguments": item["arguments"]}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
        if not last.get("content"):
            last["content"] = None
        return
    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _output_text(output: str | list[Any], dropped: list[str]) -> str:
    """A function call's output as chat's tool message takes it: text (images and files cannot go)."""
    if isinstance(output, str):
        return output
    texts = []
    for part in output:
        if isinstance(part, dict) and part.get("type") in TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            dropped.append(f"function_call_output.{part.get('type') if isinstance(part, dict) else 'part'}")
    return "".join(texts)
