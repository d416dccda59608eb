"""Uploads are checked in full before anything is kept, stream to disk, read encodings as the README says,
and leave no file behind whatever fails (issue 26: findings 2, 3, 6 and 8)."""

from __future__ import annotations

import asyncio
import gzip
import json
import tracemalloc
import zlib
from pathlib import Path

import aiohttp
import openai
import pytest

from mergebroker.broker.bulk.files import FileService
from mergebroker.broker.bulk.store import BatchStore
from tests.broker.bulk.test_batches_api import assert_own_answers, config, finished, jsonl, line, outputs

BOUNDARY = "b0undary"


def form(content: bytes, *, filename: bytes = b"in.jsonl", purpose: bytes = b"batch") -> bytes:
    """A multipart body as the SDK sends it, with the raw bytes of the file name as given."""
    return (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n".encode() + purpose
            + f"\r\n--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"".encode() + filename
            + b"\"\r\nContent-Type: application/jsonl\r\n\r\n" + content + f"\r\n--{BOUNDARY}--\r\n".encode())


async def post_form(b, body: bytes, **headers: str) -> tuple[int, dict]:
    async with b.http.post("/v1/files", data=body, headers={
            "Content-Type": f"multipart/form-data; boundary={BOUNDARY}", **headers}) as resp:
        return resp.status, await resp.json()


def stored(tmp_path: Path) -> list[str]:
    """The names of every file the Batch API holds on disk."""
    return sorted(p.name for p in (tmp_path / "files").iterdir())


async def test_a_file_name_that_is_not_utf8_is_a_400_and_leaves_nothing_on_disk(simulator, start_broker, tmp_path):
    b = await start_broker(config(simulator, tmp_path))
    for _ in range(3):
        status, body = await post_form(b, form(jsonl([line("a", "x")]), filename=b"\xff.jsonl"))
        assert status == 400 and body["error"]["code"] == "invalid_filename"
    assert stored(tmp_path) == [] and (await b.openai.files.list()).data == []
    good = await b.openai.files.create(file=("caf\u00e9.jsonl", jsonl([line("a", "x")])), purpose="batch")
    assert good.filename == "caf\u00e9.jsonl" and stored(tmp_path) == [f"{good.id}.jsonl"]


DEEP = {"x": 1}
for _ in range(900):
    DEEP = {"x": DEEP}
BAD_LINES = [
    (b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "sim-small", '
     b'"messages": [{"role": "user", "content": "lone \\ud800 surrogate"}]}}', "lone UTF-16 surrogate"),
    (b'{"custom_id": "a\\udc00", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "sim-small", '
     b'"messages": [{"role": "user", "content": "hi"}]}}', "lone UTF-16 surrogate"),
    (json.dumps({**line("a", "deep"), "body": {**line("a", "deep")["body"], "vendor": DEEP}}).encode(),
     "nested deeper than 64"),
    (b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "sim-small", '
     b'"temperature": NaN, "messages": [{"role": "user", "content": "hi"}]}}', "not valid JSON"),
    (b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "sim-small", '
     b'"temperature": 1e999, "messages": [{"role": "user", "content": "hi"}]}}', "not valid JSON"),
    (json.dumps({**line("a", "x"), "body": {"model": "sim-small", "messages": [
        {"role": "user", "content": "m"}] * 3000}}).encode(), "at most 2048 messages"),
    (json.dumps(line("a", "y" * 250_000)).encode(), "longer than 200000 bytes"),
    (b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "sim-small", '
     b'"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}}', "not valid UTF-8"),
]


@pytest.mark.parametrize("bad, expected", BAD_LINES)
async def test_a_line_the_live_endpoint_would_refuse_is_refused_at_upload(simulator, start_broker, tmp_path, bad,
                                                                          expected):
    """Lone surrogates, deep nesting, NaN, 1e999, too many messages, an oversized line: 400 naming line 2."""
    b = await start_broker({**config(simulator, tmp_path), "server": {"max_body_bytes": 200_000}})
    with pytest.raises(openai.BadRequestError) as caught:
        await b.openai.files.create(file=("bad.jsonl", jsonl([line("ok", "fine")]) + bad + b"\n"), purpose="batch")
    assert "Line 2" in caught.value.message and expected in caught.value.message
    assert stored(tmp_path) == []


async def test_lines_split_on_newline_only_so_a_raw_line_separator_is_text(simulator, start_broker, tmp_path):
    b = await start_broker(config(simulator, tmp_path))
    question = "first part\u2028second part\u0085third"
    raw = json.dumps(line("sep", question), ensure_ascii=False).encode() + b"\r\n"
    batch = await finished(b.openai, b, await _create(b, raw))
    assert batch.status == "completed"
    assert_own_answers(await outputs(b.openai, batch), {"sep": question})


async def _create(b, raw: bytes) -> str:
    uploaded = await b.openai.files.create(file=("in.jsonl", raw), purpose="batch")
    created = await b.openai.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")
    return created.id


@pytest.mark.parametrize("encoding, encode", [("gzip", gzip.compress), ("deflate", zlib.compress),
                                              ("deflate", lambda d: zlib.compress(d, wbits=-15))])
async def test_compressed_multipart_bodies_are_inflated(simulator, start_broker, tmp_path, encoding, encode):
    b = await start_broker(config(simulator, tmp_path))
    content = jsonl([line(f"q{n}", f"question {n}") for n in range(50)])
    status, body = await post_form(b, encode(form(content)), **{"Content-Encoding": encoding})
    assert status == 200, body
    assert (await b.openai.files.content(body["id"])).content == content


async def test_other_encodings_bombs_and_corrupt_bodies_are_refused(simulator, start_broker, tmp_path):
    b = await start_broker(config(simulator, tmp_path, max_file_bytes=100_000))
    content = jsonl([line("a", "x")])
    status, body = await post_form(b, form(content), **{"Content-Encoding": "br"})
    assert status == 415 and body["error"]["code"] == "unsupported_content_encoding"
    bomb = gzip.compress(form(b"\n" * 50_000_000))  # 50 MB of newlines in a 50 kB body
    status, body = await post_form(b, bomb, **{"Content-Encoding": "gzip"})
    assert status == 413 and body["error"]["code"] == "file_too_large"
    status, body = await post_form(b, gzip.compress(form(content))[:-12], **{"Content-Encoding": "gzip"})
    assert status == 400 and body["error"]["code"] == "invalid_encoding"
    status, body = await post_form(b, b"\x1f\x8b\x08\x00garbage" * 10, **{"Content-Encoding": "gzip"})
    assert status == 400 and body["error"]["code"] == "invalid_encoding"
    assert stored(tmp_path) == []


async def test_a_form_of_many_tiny_fields_is_refused_at_once(simulator, start_broker, tmp_path):
    b = await start_broker(config(simulator, tmp_path))
    fields = b"".join(f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"f{n}\"\r\n\r\nx\r\n".encode()
                      for n in range(40_000))
    status, body = await post_form(b, fields + f"--{BOUNDARY}--\r\n".encode())
    assert status == 400 and body["error"]["code"] == "too_many_fields"
    async with b.http.get("/healthz") as resp:
        assert resp.status == 200


async def test_a_tenant_streams_a_bounded_number_of_uploads_at_once(simulator, start_broker, tmp_path):
    uploads = 2  # batches.max_uploads_per_tenant (4 by default)
    b = await start_broker(config(simulator, tmp_path, max_uploads_per_tenant=uploads))
    release = asyncio.Event()
    started = [asyncio.Event() for _ in range(uploads)]
    head, tail = form(jsonl([line("a", "x")])).split(b"Content-Type: application/jsonl")

    async def slow(n: int):
        yield head
        started[n].set()
        await release.wait()  # the upload stays open, mid-body, until released
        yield b"Content-Type: application/jsonl" + tail

    async def upload(n: int) -> int:
        async with b.http.post("/v1/files", data=slow(n), headers={
                "Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}) as resp:
            return resp.status

    stalled = [asyncio.ensure_future(upload(n)) for n in range(uploads)]
    await asyncio.gather(*(e.wait() for e in started))
    for _ in range(200):  # until the broker has both uploads in hand (it reads what the client sent)
        status, body = await post_form(b, form(jsonl([line("a", "x")])))
        if status == 429:
            break
        await asyncio.sleep(0.01)
    assert status == 429 and body["error"]["code"] == "too_many_uploads"
    release.set()
    assert await asyncio.gather(*stalled) == [200] * uploads
    status, _ = await post_form(b, form(jsonl([line("a", "x")])))
    assert status == 200


async def test_a_large_upload_streams_to_disk_without_being_held_in_memory(simulator, start_broker, tmp_path):
    b = await start_broker(config(simulator, tmp_path))
    row = jsonl([line("x" * 30, "question " + "y" * 900)])
    count = 20_000  # about 20 MB
    content_rows = (row.replace(b"x" * 30, f"{n:030d}".encode()) for n in range(count))

    async def body():
        yield f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--{BOUNDARY}\r\n" \
              f"Content-Disposition: form-data; name=\"file\"; filename=\"big.jsonl\"\r\n\r\n".encode()
        chunk = []
        for r in content_rows:
            chunk.append(r)
            if len(chunk) == 200:
                yield b"".join(chunk)
                chunk = []
        yield f"\r\n--{BOUNDARY}--\r\n".encode()

    tracemalloc.start()
    try:
        async with b.http.post("/v1/files", data=body(), headers={
                "Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}) as resp:
            assert resp.status == 200, await resp.text()
            uploaded = await resp.json()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert uploaded["bytes"] == len(row) * count
    assert peak < 8 * 1024 * 1024  # the 20 MB file never sat in memory


async def test_sweep_finishes_or_undoes_what_a_crash_left_half_done(tmp_path):
    store = BatchStore(tmp_path / "state.sqlite3")
    files = FileService(tmp_path, store, max_bytes=10_000, max_lines=10, ttl_s=60, max_uploads_per_tenant=4,
                        max_form_parts=8)
    kept = await files.upload("t", "batch", "in.jsonl", jsonl([line("a", "x")]))
    await files.pin(kept, "batch_running")
    await files.pin(kept, "batch_gone")
    (tmp_path / "files" / f"{kept.id}.jsonl").rename(tmp_path / "files" / f"{kept.id}.partial")  # committed, unrenamed
    (tmp_path / "files" / "file-orphan.partial").write_bytes(b"half an upload")
    (tmp_path / "files" / "file-norecord.jsonl").write_bytes(b"bytes nobody lists")
    assert await files.sweep(["batch_running"]) == 3
    assert stored(tmp_path) == [f"{kept.id}.jsonl"]
    assert await files.content("t", kept.id) == jsonl([line("a", "x")])
    assert sorted(p.name for p in (tmp_path / "inputs").iterdir()) == ["batch_running.jsonl"]
    store.close()


async def test_a_failed_record_insert_removes_the_bytes(simulator, start_broker, tmp_path, monkeypatch):
    """Whatever fails after the bytes arrived (here the database), nothing stays on disk."""
    b = await start_broker(config(simulator, tmp_path))

    async def broken(record):
        raise OSError("disk I/O error")
    monkeypatch.setattr(b.batches._store, "add_file", broken)
    async with aiohttp.ClientSession(base_url=b.url) as session:
        async with session.post("/v1/files", data=form(jsonl([line("a", "x")])), headers={
                "Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}) as resp:
            assert resp.status == 500 and (await resp.json())["error"]["message"]
    assert stored(tmp_path) == []
