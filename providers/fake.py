"""Fakes of the provider-layer seams for unit tests: `FakeProvider` (a `Provider`) and `FakePool` (a `Pool`).

Integration tests use the real ones over the simulated upstream (`providers.simulator.server`), a real server.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

from mergebroker.providers.simulator.content import answer_for


class FakeProvider:
    """A Provider answering from a script: each call takes the next item (an exception is raised, None answers).

    With a `gate`, calls wait for it before answering; `active`/`max_active` record concurrency.
    """

    def __init__(self, name: str, script: list[BaseException | None] | None = None, *,
                 gate: asyncio.Event | None = None, usage_tokens: int | None = None) -> None:
        self.name = name
        self.calls = 0
        self.active = 0
        self.max_active = 0
        self._script = list(script or [])
        self._gate = gate
        self._usage_tokens = usage_tokens
        self.timeouts: list[float] = []

    async def _enter(self) -> None:
        self.calls += 1
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            if self._gate is not None:
                await self._gate.wait()
            action = self._script.pop(0) if self._script else None
            if action is not None:
                raise action
        finally:
            self.active -= 1

    async def chat(self, body: dict[str, Any], *, timeout: float) -> dict[str, Any]:
        self.timeouts.append(timeout)
        await self._enter()
        reply: dict[str, Any] = {"choices": [{"message": {"content": f"from {self.name}"}}]}
        if self._usage_tokens is not None:
            reply["usage"] = {"prompt_tokens": 1, "completion_tokens": self._usage_tokens - 1,
                              "total_tokens": self._usage_tokens}
        return reply

    async def stream_chat(self, body: dict[str, Any], *, timeout: float) -> AsyncIterator[bytes]:
        await self._enter()
        yield f"data: {self.name}\n\n".encode()
        yield b"data: [DONE]\n\n"

    async def embeddings(self, body: dict[str, Any], *, timeout: float) -> dict[str, Any]:
        await self._enter()
        return {"data": []}

    async def list_models(self, *, timeout: float) -> list[str]:
        return ["m"]

    async def warm_up(self, connections: int) -> None:
        return None

    async def close(self) -> None:
        return None


# A merged call's blocks as `merge.prompt` writes them (`<K42>text</K42>`). Providers may not import merge
# (`merge.prompt.request_blocks` is the one reader tests use), so this fake keeps its own one-line copy;
# tests/merge/test_prompt.py checks that it reads what `merge.prompt` writes.
_BLOCK = re.compile(r"<([A-Za-z][0-9]{2,})>(.*?)</\1>", re.S)
Merged = Callable[[list[tuple[str, str]]], dict[str, Any]]


class FakePool:
    """A `Pool` answering in-process like the simulated upstream: `answer_for(text)`, one block per merged member.

    `merged`, when given, gets a merged call's `(id, user text)` blocks and returns the reply body (or
    raises), to build broken replies. `single_calls` and `merged_calls` record the texts and blocks sent;
    `fast_fail` is what `fast_fail_after` answers.
    """

    def __init__(self, merged: Merged | None = None, *, fast_fail: float | None = None) -> None:
        self._merged = merged
        self.fast_fail = fast_fail
        self.pressure = 0.0  # what rpm_pressure reports: set it to make the provider's RPM bind
        self.single_calls: list[str] = []
        self.merged_calls: list[list[tuple[str, str]]] = []

    def fast_fail_after(self, model: str) -> float | None:
        return self.fast_fail

    def rpm_pressure(self, model: str) -> float:
        return self.pressure

    def streams_merged(self, model: str) -> bool:
        return False  # merged replies come whole: tests shape them as one body

    def limits_tokens(self, model: str) -> bool:
        return False  # the fake has no token rate

    async def chat(self, model: str, body: dict[str, Any], *, deadline: float, priority: float = 0,
                   tokens: int = 0, tenant: str | None = None) -> tuple[dict[str, Any], str]:
        text = body["messages"][-1]["content"]
        blocks = _BLOCK.findall(text)
        if blocks:
            self.merged_calls.append(blocks)
            return (self._merged or _answer_blocks)(blocks), "fake"
        self.single_calls.append(text)
        return completion(answer_for(text)), "fake"

    async def stream_chat(self, model: str, body: dict[str, Any], *, deadline: float, priority: float = 0,
                          tokens: int = 0, tenant: str | None = None) -> tuple[AsyncIterator[bytes], str]:
        answer = answer_for(body["messages"][-1]["content"])

        async def chunks() -> AsyncIterator[bytes]:
            delta = {"choices": [{"index": 0, "delta": {"content": answer}}]}
            yield b"data: " + json.dumps(delta).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return chunks(), "fake"


def _answer_blocks(blocks: list[tuple[str, str]]) -> dict[str, Any]:
    return completion("\n".join(f"<{i}>{answer_for(text)}</{i}>" for i, text in blocks))


def completion(content: Any, *, prompt_tokens: int = 10, completion_tokens: int = 10) -> dict[str, Any]:
    """A minimal `chat.completion` body answering `content` (any value, to build broken replies too)."""
    return {"id": "chatcmpl-fake", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}
