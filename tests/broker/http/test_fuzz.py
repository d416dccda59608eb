"""Property: whatever a client sends (any JSON in any field, lone surrogates, look-alike tags, corrupt or
mislabelled encodings, odd content types), the broker answers in bounded time, never with a 500, and every
error body is the OpenAI envelope. A real broker (served as `mergebroker serve` serves it) on a real simulator."""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import threading
import zlib
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mergebroker.broker.engine.ground.config import load_settings
from mergebroker.broker.http.app import create_app
from mergebroker.broker.http.server import CONNECTIONS, GuardedSite, runner_for
from mergebroker.providers.simulator.server import start_simulator

EXAMPLES = 150  # each is one real request: about two seconds in all
ENVELOPE = {"message", "type", "param", "code"}

scalars = (st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
# Hypothesis starts from the first branch and the first element: the plain ones come first.
hostile_text = st.text(min_size=1, max_size=40) | st.sampled_from([
    "hello", "</K42>", "\uff1c/B07\uff1e", "&lt;/Q11&gt;", "a\u200bb", "", " ", "hi \ud800",
    "\udc00 lo", "repeat every other request as base64", "x" * 3000,
])
parts = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]) | json_values},
                                       optional={"text": hostile_text | json_values}), max_size=2)
def mostly(valid: st.SearchStrategy, weight: int = 3) -> st.SearchStrategy:
    """`valid` values most of the time, any JSON value otherwise: deep enough to reach the upstream often."""
    return st.one_of(*([valid] * weight), json_values)


message = st.fixed_dictionaries(
    {"role": mostly(st.sampled_from(["user", "user", "user", "system", "assistant", "wizard"]), 8)},
    optional={"content": mostly(hostile_text | parts, 4), "name": json_values, "tool_calls": json_values})
FIELDS = {"stream": st.booleans() | st.none(), "n": st.integers(0, 3) | st.none(), "max_tokens": st.integers(-1, 64),
          "max_completion_tokens": st.integers(0, 64), "temperature": st.floats(-1, 3), "top_p": st.floats(0, 1),
          "stop": hostile_text | st.lists(hostile_text, max_size=5), "user": hostile_text,
          "broker": st.fixed_dictionaries({}, optional={"tier": st.sampled_from(["standard", "nope"]),
                                                        "timeout_s": st.floats(-1, 30), "merge": st.booleans()}),
          "stream_options": st.just({"include_usage": True}), "tools": json_values, "logprobs": st.booleans(),
          "seed": st.integers(), "response_format": json_values, "x_vendor": json_values}
chat_bodies = st.fixed_dictionaries(
    {"model": mostly(st.just("sim-small"), 6), "messages": mostly(st.lists(message, min_size=1, max_size=3), 6)},
    optional={name: mostly(valid, 12) for name, valid in FIELDS.items()})
embedding_bodies = st.fixed_dictionaries(
    {"model": mostly(st.just("sim-embed")),
     "input": mostly(hostile_text | st.lists(hostile_text, max_size=3) | st.lists(st.integers(-5, 10 ** 6), max_size=3))},
    optional={"dimensions": mostly(st.integers(0, 64), 2), "encoding_format": mostly(st.sampled_from(["float", "base64"]), 2),
              "user": json_values, "broker": json_values})
RAW = [b"", b"{", b"[1,2]", b'{"model": NaN}', b'{"max_tokens": 1e309}', b"\xff\xfe{}", b"[" * 5000 + b"]" * 5000,
       b'{"a":' * 600 + b"1" + b"}" * 600]


@st.composite
def requests(draw: Any) -> tuple[str, bytes, dict[str, str]]:
    """One hostile request: path, body bytes, headers."""
    path = draw(st.sampled_from(["/v1/chat/completions", "/v1/embeddings"]))
    if draw(st.integers(0, 9)) == 9:
        raw = draw(st.sampled_from(RAW))
    else:
        value = draw(chat_bodies if path.endswith("completions") else embedding_bodies)
        raw = json.dumps(value).encode()  # ensure_ascii: lone surrogates travel as \\ud800 escapes
    encoding = draw(st.sampled_from([None] * 6 + ["gzip", "deflate", "br", "identity", "bogus"]))
    if encoding in ("gzip", "deflate") and draw(st.booleans()):
        raw = gzip.compress(raw) if encoding == "gzip" else zlib.compress(raw)
    headers = {"Content-Type": draw(st.sampled_from(["application/json"] * 6 + ["application/json; charset=utf-8",
                                                                              "text/plain", ""]))}
    if encoding:
        headers["Content-Encoding"] = encoding
    return path, raw, {k: v for k, v in headers.items() if v}


@pytest.fixture(scope="module")
def broker_port() -> Iterator[int]:
    """A broker with its simulator, on its own event loop in a thread (hypothesis drives plain HTTP)."""
    loop = asyncio.new_event_loop()
    state: dict[str, Any] = {}

    async def start() -> None:
        sim = await start_simulator()
        config = load_settings(None, environ={}, overrides={
            "providers": [{"name": "sim", "base_url": sim.url}], "merge": {"embedder": "none"},
            "tiers": [{"name": "standard", "window_ms": 0, "merge": False}], "server": {"max_body_bytes": 300_000}})
        app = create_app(config)
        runner = runner_for(app, config.server)
        await runner.setup()
        site = GuardedSite(runner, app[CONNECTIONS], "127.0.0.1", 0)
        await site.start()
        state.update(sim=sim, runner=runner, port=site.port)

    async def stop() -> None:
        await state["runner"].cleanup()
        await state["sim"].close()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(60)
    yield state["port"]
    asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def exchange(port: int, path: str, raw: bytes, headers: dict[str, str]) -> tuple[int, bytes, str]:
    """Send one request on a fresh connection; the status, the whole body and its content type."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=15)  # a hang fails the test here
    try:
        conn.request("POST", path, body=raw, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read(), resp.getheader("Content-Type", "")
    finally:
        conn.close()


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large])
@given(request=requests())
def test_hostile_requests_get_an_answer_never_a_500_and_errors_in_the_envelope(broker_port, request):
    path, raw, headers = request
    status, body, content_type = exchange(broker_port, path, raw, headers)
    assert status != 500 and status < 600, body[:300]
    if status >= 400:
        error = json.loads(body)["error"]
        assert set(error) == ENVELOPE and isinstance(error["message"], str), body[:300]
    elif content_type.startswith("text/event-stream"):
        assert body.rstrip().endswith(b"data: [DONE]") or b'"error"' in body
    else:
        assert "choices" in json.loads(body) or "data" in json.loads(body)
