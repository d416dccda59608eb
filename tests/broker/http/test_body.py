"""Request bodies: corrupt or mislabelled encodings, bombs, NaN, overflowing numbers, lone surrogates and deep
nesting all get a 4xx envelope, and a real gzip or deflate body is accepted."""

from __future__ import annotations

import gzip
import zlib

import pytest

from mergebroker.broker.http.body import inflate, parse_json
from mergebroker.errors import InvalidRequest, PayloadTooLarge, UnsupportedMediaType
from mergebroker.jsonio import depth_exceeds
from tests.conftest import NO_MERGE_MODEL, provider_for

BODY = b'{"model": "sim-small", "messages": [{"role": "user", "content": "hello"}]}'


def test_inflate_decodes_gzip_zlib_and_raw_deflate():
    raw_deflate = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    assert inflate(gzip.compress(BODY), "gzip", 1000) == BODY
    assert inflate(zlib.compress(BODY), "Deflate", 1000) == BODY
    assert inflate(raw_deflate.compress(BODY) + raw_deflate.flush(), "deflate", 1000) == BODY


@pytest.mark.parametrize("raw,encoding,error", [
    (b"[" + b"1," * 70_000 + b"1]", "deflate", InvalidRequest),  # the body that hung: not deflate at all
    (b"hello " * 24_000, "deflate", InvalidRequest),
    (BODY, "gzip", InvalidRequest),
    (gzip.compress(BODY)[:-12], "gzip", InvalidRequest),  # truncated
    (gzip.compress(b" " * 50_000), "gzip", PayloadTooLarge),  # a bomb, stopped at the limit
    (BODY, "br", UnsupportedMediaType),
    (BODY, "zstd", UnsupportedMediaType),
])
def test_inflate_refuses_what_it_cannot_decode_within_the_limit(raw, encoding, error):
    with pytest.raises(error):
        inflate(raw, encoding, 10_000)


@pytest.mark.parametrize("raw", [
    b'{"x": NaN}', b'{"x": Infinity}', b'{"max_tokens": 1e309}', b'{"x": "hi \\ud800"}', b'{"x": "\\udc00 lo"}',
    b'\xff\xfe{}', b'{"x": "\xed\xa0\x80"}',  # not UTF-8; an encoded surrogate
    b'{"a": ' * 100 + b'1' + b'}' * 100,
])
def test_parse_json_refuses_what_is_not_strict_json(raw):
    with pytest.raises(InvalidRequest):
        parse_json(raw, 64)


def test_parse_json_keeps_surrogate_pairs_and_moderate_nesting():
    assert parse_json(b'{"x": "\\ud83d\\ude00"}', 64) == {"x": "\U0001F600"}
    assert parse_json(b'[' * 64 + b']' * 64, 64) is not None
    assert depth_exceeds([[[]]], 2) and not depth_exceeds([[[]]], 3)


async def test_hostile_bodies_get_the_envelope_over_http(start_broker, simulator):
    broker = await start_broker({"providers": [provider_for(simulator)], **NO_MERGE_MODEL})
    cases = [
        (b"[" + b"1," * 70_000 + b"1]", {"Content-Encoding": "deflate"}, 400),
        (b"hello " * 24_000, {"Content-Encoding": "deflate"}, 400),
        (BODY, {"Content-Encoding": "gzip"}, 400),
        (BODY, {"Content-Encoding": "br"}, 415),
        (gzip.compress(b" " * 5_000_000), {"Content-Encoding": "gzip"}, 413),
        (BODY.replace(b"hello", b"hi \\ud800"), {}, 400),
        (b'{"model": "sim-small", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1e309}', {}, 400),
    ]
    for raw, headers, status in cases:
        async with broker.http.post("/v1/chat/completions", data=raw,
                                    headers={"Content-Type": "application/json", **headers}) as resp:
            body = await resp.json()
            assert resp.status == status and set(body["error"]) == {"message", "type", "param", "code"}
    async with broker.http.post("/v1/chat/completions", data=gzip.compress(BODY),
                                headers={"Content-Type": "application/json", "Content-Encoding": "gzip"}) as resp:
        assert resp.status == 200


async def test_a_caller_without_credentials_is_refused_before_its_body_is_read(start_broker, simulator):
    """In keys mode a huge body without a key gets 401 without being parsed: even invalid JSON gets 401."""
    import hashlib

    broker = await start_broker({"providers": [provider_for(simulator)], **NO_MERGE_MODEL, "auth": {
        "mode": "keys", "keys": [{"sha256": hashlib.sha256(b"k").hexdigest(), "tenant": "t"}]}})
    huge = b'{"model": "sim-small", "messages": [' + b'{"role": "user", "content": "x"},' * 50_000 + b'{]'
    async with broker.http.post("/v1/chat/completions", data=huge,
                                headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_api_key"
    async with broker.http.post("/v1/chat/completions", data=b"{not json",
                                headers={"Content-Type": "application/json", "Authorization": "Bearer k"}) as resp:
        assert resp.status == 400  # with a key, the body is read and judged


async def test_too_many_messages_are_refused_before_validation(start_broker, simulator):
    broker = await start_broker({"providers": [provider_for(simulator)], **NO_MERGE_MODEL,
                                 "server": {"max_messages": 10}})
    messages = [{"role": "user", "content": "x"}] * 11
    async with broker.http.post("/v1/chat/completions", json={"model": "sim-small", "messages": messages}) as resp:
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "messages"
