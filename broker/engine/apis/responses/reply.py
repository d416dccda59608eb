"""A Chat Completions reply as a Responses `Response` object (pure).

The output is a `reasoning` item when the reply shows its reasoning (`reasoning_content` or `reasoning`,
as DeepSeek, vLLM and others send it), a `message` item when it has text, then one `function_call` item per tool call, its
name mapped back through the translation's `tool_names` (a namespaced function carries `namespace`
beside its plain `name`, as the SDK's `ResponseFunctionToolCall` does). Item ids are derived from the
response id and the item's place, so the streamed and the whole form of one answer name items alike.
The request's settings are echoed as OpenAI echoes them, with its defaults where the caller set none.
"""

from __future__ import annotations

from typing import Any

from mergebroker.broker.engine.apis.responses.items import item_id
from mergebroker.broker.engine.apis.responses.request import ResponsesRequest
from mergebroker.broker.engine.apis.responses.tools import ToolNames
from mergebroker.broker.engine.apis.responses.translate import ChatTranslation
from mergebroker.token_usage import NO_USAGE, TokenUsage

ID_PREFIX = {"message": "msg", "reasoning": "rs"}
_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}
# Echoed as sent, absent as None.
_ECHOED = ("instructions", "temperature", "top_p", "max_output_tokens", "reasoning", "user", "service_tier",
           "prompt_cache_key", "safety_identifier", "max_tool_calls", "top_logprobs", "prompt_cache_retention")


def from_chat(reply: dict[str, Any], request: ResponsesRequest, translation: ChatTranslation, *,
              response_id: str, created_at: int, previous_response_id: str | None = None) -> dict[str, Any]:
    """The Response for a chat completion `reply` to `translation` of `request`."""
    choices = reply.get("choices") or [{}]
    message = choices[0].get("message") or {}
    output: list[dict[str, Any]] = []
    for kind, text in (("reasoning", reasoning_text(message)), ("message", message.get("content"))):
        if isinstance(text, str) and text:
            output.append(text_item(kind, item_id(ID_PREFIX[kind], response_id, len(output)), text, "completed"))
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        index = len(output)
        output.append(call_item(item_id("fc", response_id, index), call.get("id") or item_id("call", response_id, index),
                                function.get("name") or "", function.get("arguments") or "", translation.tool_names,
                                "completed"))
    return response_object(request, response_id=response_id, created_at=created_at,
                           model=reply.get("model") or request.model, output=output,
                           finish_reason=choices[0].get("finish_reason"),
                           usage=TokenUsage.from_body(reply) or NO_USAGE, previous_response_id=previous_response_id)


def reasoning_text(message: dict[str, Any]) -> str | None:
    """The reasoning a chat message (or a stream's delta) shows, under either name providers give it."""
    text = message.get("reasoning_content") or message.get("reasoning")
    return text if isinstance(text, str) else None


def text_part(kind: str, text: str) -> dict[str, Any]:
    """The one content part of a `message` (`output_text`) or `reasoning` (`reasoning_text`) item."""
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": []}


def text_item(kind: str, item: str, text: str, status: str) -> dict[str, Any]:
    """An assistant `message` item, or a `reasoning` item (no summary, its text as content), of one part."""
    if kind == "reasoning":
        return {"id": item, "type": "reasoning", "status": status, "summary": [], "content": [text_part(kind, text)]}
    return {"id": item, "type": "message", "role": "assistant", "status": status, "content": [text_part(kind, text)]}


def call_item(item: str, call_id: str, chat_name: str, arguments: str, names: ToolNames,
              status: str) -> dict[str, Any]:
    """A `function_call` output item, its chat name mapped back to the caller's (namespace, name)."""
    namespace, name = names.get(chat_name, (None, chat_name))
    call = {"id": item, "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}
    if namespace is not None:
        call["namespace"] = namespace
    return call


def incomplete_reason(finish_reason: str | None) -> str | None:
    """The Responses `incomplete_details.reason` for a chat `finish_reason` (None: the answer is whole)."""
    return _INCOMPLETE.get(finish_reason or "")


def response_object(request: ResponsesRequest, *, response_id: str, created_at: int, model: str,
                    output: list[dict[str, Any]], finish_reason: str | None, usage: TokenUsage | None,
                    previous_response_id: str | None, status: str | None = None,
                    error: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Response object: `status` completed, or incomplete when `finish_reason` says the answer was cut
    (its last item then incomplete too); `status` given outright for in_progress and failed. `usage` None is
    left null (a response still in progress)."""
    raw = request.body
    reason = incomplete_reason(finish_reason)
    if status is None:
        status = "incomplete" if reason else "completed"
    if status == "incomplete" and output:
        output = [*output[:-1], {**output[-1], "status": "incomplete"}]  # the one the cut fell in
    response: dict[str, Any] = {
        "id": response_id, "object": "response", "created_at": created_at, "status": status, "error": error,
        "incomplete_details": {"reason": reason} if status == "incomplete" else None,
        "model": model, "output": output,
        "parallel_tool_calls": raw.get("parallel_tool_calls", True) is not False,
        "tool_choice": raw.get("tool_choice") or "auto", "tools": list(request.tools),
        "text": raw.get("text") or {"format": {"type": "text"}},
        "metadata": raw.get("metadata") or {}, "store": request.store, "background": request.background,
        "previous_response_id": previous_response_id or request.previous_response_id,
        "truncation": raw.get("truncation") or "disabled",
        "usage": usage.as_responses() if usage is not None else None,
    }
    response.update({name: raw.get(name) for name in _ECHOED})
    return response
