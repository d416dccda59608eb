"""The broker speaks the OpenAI HTTP API end to end against the simulated upstream."""

from __future__ import annotations

import pytest

from providers.simulator import answer_for
from tests.conftest import provider_for

PASSTHROUGH = {"merge": {"enabled": False}}


async def test_chat_completion_through_the_openai_sdk_returns_the_upstream_answer(simulator, start_broker):
    broker = await start_broker({"providers": [provider_for(simulator)], **PASSTHROUGH})
    reply = await broker.openai.chat.completions.create(
        model="sim-small", messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert reply.choices[0].message.content == answer_for("What is the capital of France?")
    assert reply.usage.prompt_tokens > 0
    assert simulator.stats()["chat_calls"] == 1
