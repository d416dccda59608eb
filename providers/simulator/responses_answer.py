"""What the simulated model answers a Responses call (pure): its output items, status and token counts.

The same rules as the chat route and the Anthropic mode, in the Responses API's items:
- input ending in tool outputs: a message quoting them (`agent.after_tools`);
- `text.format` json_schema / json_object: a message holding JSON of the schema's shape (`agent.instance`);
- function tools and input ending in a user message: `function_call` items (`agent.tool_calls`; a tool from a
  namespace names it in `namespace`);
- otherwise the simulator's usual answer (`content.compose_reply`: merged calls block by block, faults).
A `reasoning` request (effort other than "none") puts a reasoning item first, with a summary when one is
asked and `encrypted_content` when `include` asks for it. `max_output_tokens` bounds reasoning and text
together: a text cut there leaves the message and the response `incomplete` (reason `max_output_tokens`).
"""

from __future__ import annotations

import base64
import json
import random
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mergebroker.providers.simulator.agent import after_tools, instance, tool_calls
from mergebroker.providers.simulator.content import (
    answer_for,
    compose_reply,
    count_tokens,
    cut_to_tokens,
    question_text,
)
from mergebroker.providers.simulator.faults import SimulatorConfig
from mergebroker.providers.simulator.responses_input import ToolSet, ends_with_user, trailing_outputs

REASONING_SUMMARY = "The simulated model weighs the request before it answers."
_ENCRYPTED = "reasoning.encrypted_content"


def new_id(prefix: str) -> str:
    """An id in OpenAI's form: a prefix, an underscore, 48 hex digits."""
    return f"{prefix}_{uuid.uuid4().hex}{uuid.uuid4().hex[:16]}"


@dataclass(frozen=True)
class Outcome:
    """A composed answer: its output items (complete), whether it was cut at `max_output_tokens`, its output and
    reasoning tokens, and the faults that shaped it."""

    output: tuple[dict[str, Any], ...]
    incomplete: bool
    output_tokens: int
    reasoning_tokens: int
    faults: tuple[str, ...] = ()

    @property
    def text(self) -> str:
        """The text of its messages."""
        return "".join(part["text"] for item in self.output if item["type"] == "message" for part in item["content"])


def message_item(text: str, *, incomplete: bool = False) -> dict[str, Any]:
    """An assistant output message holding `text` as one `output_text` part."""
    return {"type": "message", "id": new_id("msg"), "role": "assistant",
            "status": "incomplete" if incomplete else "completed",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def reasoning_item(reasoning: Any, include: Sequence[Any]) -> dict[str, Any] | None:
    """The reasoning item a `reasoning` request gets first, or None (no reasoning asked, or effort "none")."""
    if not isinstance(reasoning, Mapping) or reasoning.get("effort") == "none":
        return None
    summary = [{"type": "summary_text", "text": REASONING_SUMMARY}] if reasoning.get("summary") else []
    item: dict[str, Any] = {"type": "reasoning", "id": new_id("rs"), "summary": summary}
    if _ENCRYPTED in include:
        item["encrypted_content"] = base64.b64encode(f"sim-reasoning:{uuid.uuid4().hex}".encode()).decode()
    return item


def compose_output(body: Mapping[str, Any], items: Sequence[Mapping[str, Any]], messages: list[dict[str, Any]],
                   tools: ToolSet, fmt: Mapping[str, Any], *, config: SimulatorConfig,
                   rng: random.Random) -> Outcome:
    """The answer to a Responses call whose input is `items` (`messages` as chat-shaped turns)."""
    reasoning = reasoning_item(body.get("reasoning"), body.get("include") or [])
    thought = count_tokens(REASONING_SUMMARY) if reasoning is not None else 0
    budget = body.get("max_output_tokens")
    text_budget = None if budget is None else max(0, budget - thought)
    first = [reasoning] if reasoning is not None else []
    question = question_text(messages) if messages else ""
    outputs = trailing_outputs(items)
    calls = tool_calls(list(tools.tools), tools.choice, named=tools.named,
                       parallel=body.get("parallel_tool_calls") is not False, seed=question) \
        if tools.tools and ends_with_user(items) and not outputs else []
    if calls:
        made = [_function_call(name, value, tools.namespace_of(name)) for name, value in calls]
        spent = sum(count_tokens(call["arguments"]) for call in made)
        return Outcome(tuple(first + made), False, thought + spent, thought)
    faults: tuple[str, ...] = ()
    if outputs:
        text, spent, cut = cut_to_tokens(after_tools(outputs), text_budget)
    elif fmt["type"] == "json_schema":
        text, spent, cut = cut_to_tokens(json.dumps(instance(fmt["schema"], question)), text_budget)
    elif fmt["type"] == "json_object":
        text, spent, cut = cut_to_tokens(json.dumps({"answer": answer_for(question, config.answer_words)}),
                                         text_budget)
    else:
        reply = compose_reply(messages, max_tokens=text_budget, config=config, rng=rng)
        text, spent, cut, faults = reply.content, reply.completion_tokens, reply.finish_reason == "length", reply.faults
    return Outcome(tuple(first + [message_item(text, incomplete=cut)]), cut, thought + spent, thought, faults)


def _function_call(name: str, value: Any, namespace: str | None) -> dict[str, Any]:
    call = {"type": "function_call", "id": new_id("fc"), "call_id": new_id("call"), "name": name,
            "arguments": json.dumps(value), "status": "completed"}
    return {**call, "namespace": namespace} if namespace else call
