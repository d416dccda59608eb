"""OpenAI `image_url` parts as Anthropic image blocks, within the Messages API's limits (pure).

A data URL becomes a base64 source, an http(s) URL a URL source (Anthropic fetches it). A base64 image
is checked here, where the 400 can name the part, against what the Messages API refuses: its format
(JPEG, PNG, GIF or WebP, read from the bytes themselves: a mislabelled media type is corrected),
its size (5 MB) and its sides (8000 px, or 2000 px in a request of more than 20 images); a request may
hold at most 100 images. OpenAI's `detail` has no Anthropic counterpart (Anthropic sizes images
itself) and is left behind.
"""

from __future__ import annotations

import base64
import binascii
import struct
from collections.abc import Sequence
from typing import Any

from mergebroker.providers.anthropic.refuse import refuse

MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
MAX_IMAGE_BYTES = 5 * 1024 * 1024
MAX_IMAGES = 100
MAX_SIDE_PX = 8000
MANY_IMAGES = 20
MANY_IMAGES_SIDE_PX = 2000
"""Past `MANY_IMAGES` images in one request, each side may be at most `MANY_IMAGES_SIDE_PX`."""

Sniffed = tuple[str, int | None, int | None]
"""What an image's bytes say: its media type, and its width and height when the header gives them."""


def count_images(messages: Sequence[Any]) -> int:
    """How many `image_url` parts the messages hold."""
    return sum(1 for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
               for part in m["content"] if isinstance(part, dict) and part.get("type") == "image_url")


def image_block(part: dict[str, Any], where: str, *, images: int) -> dict[str, Any]:
    """The image block for the `image_url` part at `where`, in a request of `images` images."""
    if images > MAX_IMAGES:
        raise refuse("messages", f"the request holds {images} images; Anthropic takes at most {MAX_IMAGES}")
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str) or not url:
        raise refuse(f"{where}.image_url.url", "an image part needs a URL")
    if url.startswith("data:"):
        source = _base64_source(url, f"{where}.image_url.url", images)
    elif url.startswith(("http://", "https://")):
        source = {"type": "url", "url": url}
    else:
        raise refuse(f"{where}.image_url.url", "only data URLs and http(s) URLs are translated")
    return {"type": "image", "source": source}


def _base64_source(url: str, where: str, images: int) -> dict[str, Any]:
    header, comma, data = url[len("data:"):].partition(",")
    if not comma or not header.lower().endswith(";base64"):
        raise refuse(where, "a data URL must be base64-encoded (data:image/png;base64,...)")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise refuse(where, "the data URL is not valid base64") from None
    sniffed = sniff(raw)
    if sniffed is None:
        declared = header[: -len(";base64")].strip().lower() or "unknown"
        raise refuse(where, f"the data is not a JPEG, PNG, GIF or WebP image (declared '{declared}'), "
                            "the formats Anthropic takes")
    media, width, height = sniffed
    if len(raw) > MAX_IMAGE_BYTES:
        raise refuse(where, f"the image is {len(raw) / 2**20:.1f} MB; Anthropic takes at most 5 MB per image")
    limit = MANY_IMAGES_SIDE_PX if images > MANY_IMAGES else MAX_SIDE_PX
    if max(width or 0, height or 0) > limit:
        raise refuse(where, f"the image is {width}x{height} px; Anthropic takes at most {limit} px per side"
                            + (f" in a request of more than {MANY_IMAGES} images" if images > MANY_IMAGES else ""))
    return {"type": "base64", "media_type": media, "data": data}


def sniff(raw: bytes) -> Sniffed | None:
    """The media type and size an image's own header declares (None when it is none of the four formats)."""
    if raw.startswith(b"\x89PNG\r\n\x1a\n"):
        return ("image/png", *struct.unpack(">II", raw[16:24])) if len(raw) >= 24 else ("image/png", None, None)
    if raw[:6] in (b"GIF87a", b"GIF89a"):
        return ("image/gif", *struct.unpack("<HH", raw[6:10])) if len(raw) >= 10 else ("image/gif", None, None)
    if raw[:4] == b"RIFF" and raw[8:12] == b"WEBP":
        return ("image/webp", *_webp_size(raw))
    if raw.startswith(b"\xff\xd8"):
        return ("image/jpeg", *_jpeg_size(raw))
    return None


def _webp_size(raw: bytes) -> tuple[int | None, int | None]:
    chunk = raw[12:16]
    if chunk == b"VP8 " and len(raw) >= 30:
        width, height = struct.unpack("<HH", raw[26:30])
        return width & 0x3FFF, height & 0x3FFF
    if chunk == b"VP8L" and len(raw) >= 25:
        bits = int.from_bytes(raw[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X" and len(raw) >= 30:
        return int.from_bytes(raw[24:27], "little") + 1, int.from_bytes(raw[27:30], "little") + 1
    return None, None


def _jpeg_size(raw: bytes) -> tuple[int | None, int | None]:
    """Width and height from the first start-of-frame marker (markers C0-CF except C4, C8 and CC)."""
    at = 2
    while at + 9 <= len(raw) and raw[at] == 0xFF:
        marker, length = raw[at + 1], int.from_bytes(raw[at + 2:at + 4], "big")
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            height, width = struct.unpack(">HH", raw[at + 5:at + 9])
            return width, height
        at += 2 + length
    return None, None
