"""The Responses mode's memory: stored responses, the input items each was given, the conversation each ends.

`store: true` (the API's default) keeps a response here; `previous_response_id` continues the conversation a
stored response ended (its context: the inputs before it, its own input, its output), as OpenAI does.
Instructions are not carried over, as OpenAI documents. At most `max_entries` responses are kept, the least
recently used leaving first, so a long benchmark cannot grow the simulator without bound.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from mergebroker.providers.simulator.responses_answer import new_id

MAX_ENTRIES = 10_000


@dataclass(frozen=True)
class Stored:
    """One stored response, the input items it was answered from (the previous responses' context first, as
    `GET /v1/responses/{id}/input_items` lists them) and the context it ends."""

    response: dict[str, Any]
    input_items: tuple[dict[str, Any], ...]
    context: tuple[dict[str, Any], ...]


def with_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as the API lists them: each with an id (messages `msg_`, others their type's prefix)."""
    prefixes = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
    return [item if item.get("id") else {"id": new_id(prefixes.get(item.get("type", ""), "item")), **item}
            for item in items]


class ResponseStore:
    """Stored responses by id (bounded, least recently used out first)."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self._max_entries = max_entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> Stored | None:
        """The stored response, or None."""
        stored = self._entries.get(response_id)
        if stored is not None:
            self._entries.move_to_end(response_id)
        return stored

    def context(self, response_id: str) -> list[dict[str, Any]] | None:
        """The conversation a stored response ends (inputs before, its input, its output), or None."""
        stored = self.get(response_id)
        return None if stored is None else list(stored.context)

    def put(self, response: dict[str, Any], input_items: list[dict[str, Any]], prior: list[dict[str, Any]]) -> None:
        """Keep `response`, given `input_items` after the `prior` context."""
        context = (*prior, *input_items, *response["output"])
        self._entries[response["id"]] = Stored(response, tuple(prior) + tuple(input_items), context)
        self._entries.move_to_end(response["id"])
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        """Forget a response; False if it was not stored."""
        return self._entries.pop(response_id, None) is not None

    def clear(self) -> None:
        """Forget every response."""
        self._entries.clear()
