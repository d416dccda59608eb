"""A merged call to an Anthropic upstream marks two cache breakpoints, after the shared system prompt and after
the merged header, so the next merged call reads both from Anthropic's cache, as the merge's cost model
assumes."""

from __future__ import annotations

import asyncio

import aiohttp

from mergebroker.combined_header import split_combined_header
from mergebroker.merge.prompt import DEFAULT_HEADER
from mergebroker.providers.anthropic.translate import to_messages
from mergebroker.providers.simulator.server import count_tokens, start_simulator

SYSTEM = " ".join(["Answer questions about the manual of the Nimbus product, plainly and briefly."] * 150)
BATCH = [{"name": "batch", "priority": 0, "window_ms": 60_000, "max_batch": 4, "similarity_threshold": 0.0}]


def test_the_header_of_a_combined_message_is_cut_where_the_blocks_begin():
    header, blocks = split_combined_header(DEFAULT_HEADER + "\n\n<K42>a question</K42>\n<B17>another</B17>")
    assert header == DEFAULT_HEADER + "\n\n" and blocks.startswith("<K42>")
    assert split_combined_header("a plain question, no blocks") is None
    assert split_combined_header("\n\n<K42>only blocks</K42>") is None


def test_a_plain_request_keeps_one_breakpoint_and_its_text_as_sent():
    body = to_messages({"model": "claude-x", "messages": [{"role": "system", "content": SYSTEM},
                                                                {"role": "user", "content": "Hello?"}]},
                            default_max_tokens=64).body
    assert body["system"][0]["cache_control"] == {"type": "ephemeral"}
    assert body["messages"][0]["content"] == "Hello?"


async def test_consecutive_merged_calls_read_system_prompt_and_header_from_the_cache(start_broker):
    async with await start_simulator() as sim:
        broker = await start_broker({"providers": [{"name": "claude", "kind": "anthropic", "base_url": sim.url,
                                                    "api_key_env": "ANTHROPIC_KEY", "models": ["claude-x"]}],
                                     "tiers": BATCH, "default_tier": "batch",
                                     "merge": {"embedder": "none", "policy": "always"}},
                                    environ={"ANTHROPIC_KEY": "sk-ant-test"})

        async def round_(n: int) -> None:
            answers = await asyncio.gather(*(broker.chat(f"Round {n}: how do I reset device {i}?", model="claude-x",
                                                         system=SYSTEM) for i in range(4)))
            assert [(status, headers["X-Broker-Batch-Size"]) for status, _, headers in answers] == [(200, "4")] * 4

        async with aiohttp.ClientSession() as http:
            await round_(0)
            async with http.get(sim.url + "/_sim/last_request") as resp:
                sent = (await resp.json())["body"]
            assert sent["system"][0]["cache_control"] == {"type": "ephemeral"}
            header_block, blocks = sent["messages"][0]["content"]
            assert header_block["cache_control"] == {"type": "ephemeral"} and header_block["text"].startswith(
                DEFAULT_HEADER)
            assert "cache_control" not in blocks and blocks["text"].startswith("<")
            read_before = sim.stats()["cache_read_input_tokens"]
            await round_(1)
            async with http.get(sim.url + "/_sim/last_request") as resp:
                assert (await resp.json())["body"]["messages"][0]["content"][0]["text"] == header_block["text"]
        # The second call read the system prompt and the header (the simulator counts o200k_base tokens).
        read = sim.stats()["cache_read_input_tokens"] - read_before
        assert read >= count_tokens(SYSTEM) + count_tokens(DEFAULT_HEADER)
