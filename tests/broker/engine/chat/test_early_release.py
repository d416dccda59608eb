"""Early release: a merged member is answered as soon as its block closes, while later blocks still stream.

The upstream is a real loopback server that streams a merged reply block by block and holds the rest
back until the test lets it go, so "answered before the reply ended" is shown without timing.
"""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3

import pytest
from aiohttp import web

from mergebroker.merge.prompt import request_blocks, response_block
from tests.helpers.polling import wait_until

USAGE = {"prompt_tokens": 400, "completion_tokens": 40, "total_tokens": 440}


class GatedUpstream:
    """Streams answer blocks for a merged call; waits on `gate` before the blocks after the first."""

    def __init__(self, *, break_after_first: bool = False, leak_second: bool = False, by_word: bool = False,
                 break_mid_second: bool = False, alone_like_merged: bool = False) -> None:
        self.gate = asyncio.Event()
        self.first_sent = asyncio.Event()
        self.bodies: list[dict] = []
        self.break_after_first = break_after_first
        self.leak_second = leak_second
        self.by_word = by_word  # one event per word instead of two per block
        self.break_mid_second = break_mid_second  # drop the connection three words before the second block ends
        self.alone_like_merged = alone_like_merged  # a call of one's own answers as the merged block did

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        blocks = request_blocks(body["messages"][-1]["content"])
        if not blocks:
            text = ("answer to " if self.alone_like_merged else "alone: ") + body["messages"][-1]["content"]
            if body.get("stream"):
                return await self._stream(request, [text], usage=None)
            return web.json_response({"id": "c", "object": "chat.completion", "created": 1, "model": body["model"],
                                      "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                                   "finish_reason": "stop"}], "usage": USAGE})
        parts = []
        for n, (member_id, question) in enumerate(blocks):
            answer = f"answer to {question}"
            if n == 1 and self.leak_second:
                answer += " " + blocks[0][1]  # quotes the first member's request: a leak
            parts.append(response_block(member_id, f"\n{answer}\n") + "\n")
        return await self._stream(request, parts, usage=USAGE)

    async def _stream(self, request: web.Request, parts: list[str], usage: dict | None) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for n, part in enumerate(parts):
            if n == 1:
                self.first_sent.set()
                await self.gate.wait()
                if self.break_after_first:
                    request.transport.close()  # the upstream drops mid-reply
                    return response
            pieces = re.findall(r"\S+\s*|\s+", part) if self.by_word else (part[:3], part[3:])  # a tag cut in two
            if n == 1 and self.break_mid_second:
                for piece in pieces[:-4]:
                    await response.write(sse({"choices": [{"index": 0, "delta": {"content": piece}}]}))
                request.transport.close()
                return response
            for piece in pieces:
                await response.write(sse({"choices": [{"index": 0, "delta": {"content": piece}}]}))
        await response.write(sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))
        if usage:
            await response.write(sse({"choices": [], "usage": usage}))
        await response.write(b"data: [DONE]\n\n")
        return response


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps({"id": "chunk-1", "created": 7, "model": "m", **obj}).encode() + b"\n\n"


@pytest.fixture
async def gated():
    servers = []

    async def start(**options) -> tuple[GatedUpstream, str]:
        upstream = GatedUpstream(**options)
        runner = web.AppRunner(upstream.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        servers.append(runner)
        return upstream, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1"

    yield start
    for runner in servers:
        await runner.cleanup()


def config(url: str, tmp_path, **provider) -> dict:
    return {"providers": [{"name": "gated", "base_url": url, **provider}], "merge": {"embedder": "none"},
            "cache": {"enabled": False}, "ledger": {"path": str(tmp_path / "ledger.sqlite3"), "flush_interval_s": 0.05},
            "tiers": [{"name": "batch", "window_ms": 50, "max_batch": 2, "similarity_threshold": 0.0,
                       "window_policy": "fixed"}], "default_tier": "batch"}


async def ledger_rows(broker, tmp_path, count: int) -> list[tuple[int, int]]:
    """The ledger's (prompt, completion) rows once `count` are written: a record released early waits for the
    merged call's end, which the broker reaches on its own loop after the client has its answer."""
    async def written() -> list[tuple[int, int]] | None:
        await broker.broker.ledger.flush()
        rows = sqlite3.connect(tmp_path / "ledger.sqlite3").execute(
            "SELECT prompt_tokens, completion_tokens FROM ledger").fetchall()
        return rows if len(rows) >= count else None

    # interval 0: the broker's tasks run on this same loop, so each look only yields to them
    return await wait_until(written, 10, f"fewer than {count} ledger rows written", interval_s=0)


async def released_in_turn(started: tuple[GatedUpstream, str], start_broker, tmp_path) -> list[tuple]:
    """Two members merged; the upstream lets its later blocks go once the first was sent; both results."""
    upstream, url = started
    broker = await start_broker(config(url, tmp_path))
    first, second = await two_members(broker)
    await upstream.first_sent.wait()
    upstream.gate.set()
    return [await asyncio.wait_for(t, 30) for t in (first, second)]


async def two_members(broker) -> tuple[asyncio.Task, asyncio.Task]:
    first = asyncio.create_task(broker.chat("first question: how do tides form along a long rocky coast"))
    second = asyncio.create_task(broker.chat("second question: why do cats purr when they are content"))
    return first, second


async def test_the_first_member_is_answered_while_the_second_block_is_still_held(gated, start_broker, tmp_path):
    upstream, url = await gated()
    broker = await start_broker(config(url, tmp_path))
    first, second = await two_members(broker)
    done, _ = await asyncio.wait({first, second}, return_when=asyncio.FIRST_COMPLETED, timeout=30)
    assert not upstream.gate.is_set() and len(done) == 1  # one answer out, the reply not finished
    status, body, headers = done.pop().result()
    assert status == 200 and headers["X-Broker-Batch-Size"] == "2"
    assert body["choices"][0]["message"]["content"].startswith("answer to ")
    assert body["usage"]["completion_tokens"] > 0  # counted, before the upstream reported anything
    upstream.gate.set()
    assert (await asyncio.wait_for(next(t for t in (first, second) if not t.done()), 30))[0] == 200
    assert upstream.bodies[0]["stream"] is True and upstream.bodies[0]["stream_options"] == {"include_usage": True}
    rows = await asyncio.wait_for(ledger_rows(broker, tmp_path, 2), 30)
    assert sum(p for p, _ in rows) == USAGE["prompt_tokens"]  # settled with the reported usage
    assert sum(c for _, c in rows) == USAGE["completion_tokens"]


async def test_a_leaking_block_is_re_sent_alone_and_the_others_keep_early_answers(gated, start_broker, tmp_path):
    results = await released_in_turn(await gated(leak_second=True), start_broker, tmp_path)
    contents = sorted(r[1]["choices"][0]["message"]["content"] for r in results)
    assert all(r[0] == 200 for r in results)
    assert any(c.startswith("alone: ") for c in contents) and any(c.startswith("answer to ") for c in contents)
    assert any(r[2].get("X-Broker-Fallback") == "leak" for r in results)


async def test_an_upstream_that_drops_mid_reply_costs_only_the_open_members_a_second_call(gated, start_broker,
                                                                                          tmp_path):
    results = await released_in_turn(await gated(break_after_first=True), start_broker, tmp_path)
    assert [r[0] for r in results] == [200, 200]
    fallbacks = [r[2].get("X-Broker-Fallback") for r in results]
    assert sorted(fallbacks, key=str) == [None, "merged_call_failed"]


async def test_early_release_off_sends_the_merged_call_whole(gated, start_broker, tmp_path):
    upstream, url = await gated()
    upstream.gate.set()
    broker = await start_broker(config(url, tmp_path, early_release=False))
    first, second = await two_members(broker)
    assert [(await asyncio.wait_for(t, 30))[0] for t in (first, second)] == [200, 200]
    assert "stream" not in upstream.bodies[0]
