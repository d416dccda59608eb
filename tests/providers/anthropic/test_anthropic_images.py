"""Image parts become Anthropic image blocks (data URLs as base64 sources, http(s) URLs as URL sources), with the
format read from the bytes, and images over the Messages API's limits refused with a 400 naming the part."""

from __future__ import annotations

import base64
import struct

import pytest

from mergebroker.errors import UpstreamUnsupported
from mergebroker.providers.anthropic.images import sniff
from mergebroker.providers.anthropic.translate import to_messages


def png(width: int = 1, height: int = 1, padding: int = 0) -> bytes:
    """A PNG signature and header chunk declaring `width` x `height` (enough for any reader of the header)."""
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I4sII", 13, b"IHDR", width, height) + b"\x08\x06\x00\x00\x00" \
        + b"\x00" * padding


def data_url(raw: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(raw).decode()


def image(url: str, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def blocks(*parts) -> list:
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, *parts]}]}
    return to_messages(body, default_max_tokens=64).body["messages"][0]["content"]


def test_a_data_url_becomes_a_base64_source_and_a_web_url_a_url_source():
    encoded = base64.b64encode(png()).decode()
    out = blocks(image(data_url(png()), detail="high"), image("https://example.com/cat.jpg"))
    assert out == [{"type": "text", "text": "What is this?"},
                   {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": encoded}},
                   {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.jpg"}}]


def test_a_mislabelled_image_is_sent_with_the_type_its_bytes_declare():
    [_, block] = blocks(image(data_url(png(), media="image/jpeg")))
    assert block["source"]["media_type"] == "image/png"


@pytest.mark.parametrize("raw, expected", [
    (png(640, 480), ("image/png", 640, 480)),
    (b"GIF89a" + struct.pack("<HH", 32, 16) + b"\x00" * 8, ("image/gif", 32, 16)),
    (b"\xff\xd8\xff\xe0" + struct.pack(">H", 16) + b"\x00" * 14 + b"\xff\xc0" + struct.pack(">HBHH", 17, 8, 300, 200),
     ("image/jpeg", 200, 300)),
    (b"RIFF\x00\x00\x00\x00WEBPVP8X" + b"\x00" * 8 + (99).to_bytes(3, "little") + (49).to_bytes(3, "little"),
     ("image/webp", 100, 50)),
    (b"BM" + b"\x00" * 40, None),
])
def test_the_format_and_size_are_read_from_the_image_header(raw, expected):
    assert sniff(raw) == expected


@pytest.mark.parametrize("part, why", [
    (image("data:image/png;base64,%%%"), "not valid base64"),
    (image("data:image/png,rawbytes"), "base64"),
    (image(data_url(b"BM" + b"\x00" * 40, "image/bmp")), "JPEG, PNG, GIF or WebP"),
    (image(data_url(png(padding=5 * 1024 * 1024))), "at most 5 MB"),
    (image(data_url(png(9000, 10))), "at most 8000 px"),
    (image("ftp://example.com/cat.png"), "http(s)"),
])
def test_an_image_over_the_limits_is_refused_naming_its_part(part, why):
    with pytest.raises(UpstreamUnsupported) as info:
        blocks(image("https://example.com/fine.png"), part)
    assert info.value.param == "messages[0].content[2].image_url.url" and why in info.value.message


def test_more_than_twenty_images_must_be_smaller_and_more_than_a_hundred_are_refused():
    small, large = image(data_url(png(1500, 1500))), image(data_url(png(2500, 2500)))
    assert len(blocks(*[small] * 21)) == 22
    with pytest.raises(UpstreamUnsupported, match="2000 px"):
        blocks(*[small] * 20, large)
    assert len(blocks(*[large] * 20)) == 21
    with pytest.raises(UpstreamUnsupported) as info:
        blocks(*[image("https://example.com/a.png")] * 101)
    assert info.value.param == "messages"
