"""Split a merged reply into the members' answers, by ID and never by position.

The reply is scanned for `response` tags (any case, spaces around `<`, `/`, `=` and the quotes).
Chatter outside blocks is ignored, blocks may come in any order, and a block whose ID belongs to no
member is never routed to anyone. Every member gets either its stripped answer or a `BlockFailure`.
When in doubt the parser reports a failure: a failed member falls back to its own upstream call,
while a wrongly routed answer would be a silent bug.

Failures, in order of precedence for one ID:
    DUPLICATED  the ID opens more than one block
    TRUNCATED   the reply ends inside the block (the last one) and finish_reason is "length"
    MALFORMED   a garbled or nested tag inside, around or for the block, or a block never closed
    EMPTY       the block holds only whitespace
    FOREIGN_ID  the block mentions another member's ID
    MISSING     no block for the ID
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Sequence


class BlockFailure(enum.Enum):
    """Why a member got no answer out of a merged reply."""

    MISSING = "missing"
    EMPTY = "empty"
    DUPLICATED = "duplicated"
    MALFORMED = "malformed"
    TRUNCATED = "truncated"
    FOREIGN_ID = "foreign_id"


# Anything that starts like a response tag; [^<>]* cannot backtrack badly and stops at the next tag.
_TAG = re.compile(r"<\s*(/)?\s*response\b([^<>]*)(>)?", re.IGNORECASE)
_STRICT_ID = re.compile(r"""\s+id\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s"'=]+))\s*""", re.IGNORECASE)
_LOOSE_ID = re.compile(r"""id\s*=\s*["']?\s*([0-9a-z]+)""", re.IGNORECASE)
# A tail that may still become a response tag: "<", "< /", "<resp", "<response id='ab" (no ">" yet).
_TAG_PREFIX = re.compile(r"<\s*/?\s*(?:r(?:e(?:s(?:p(?:o(?:n(?:s(?:e\b[^<>]*)?)?)?)?)?)?)?)?\Z", re.IGNORECASE)


@dataclass
class _Block:
    """One opened block while scanning; `id` is None when the tag named no readable ID."""

    id: str | None
    start: int
    end: int | None = None
    malformed: bool = False
    closed: bool = False


@dataclass
class _Scan:
    blocks: list[_Block] = field(default_factory=list)
    open: _Block | None = None
    last_closed: _Block | None = None


def split_reply(
    content: str, ids: Sequence[str], *, finish_reason: str | None
) -> dict[str, str | BlockFailure]:
    """Map every ID in `ids` to its answer text (stripped) or to the `BlockFailure` that prevents one."""
    blocks = _scan(content if isinstance(content, str) else "")
    wanted = {i.lower(): i for i in ids}
    by_id: dict[str, list[_Block]] = {}
    for block in blocks:
        if block.id is not None and block.id in wanted:
            by_id.setdefault(block.id, []).append(block)
    last = blocks[-1] if blocks else None
    result: dict[str, str | BlockFailure] = {}
    for key, original in wanted.items():
        found = by_id.get(key, [])
        result[original] = _resolve(content, found, key, wanted, last, finish_reason)
    return result


def truncated_block(content: str, ids: Sequence[str], *, finish_reason: str | None) -> tuple[str, str] | None:
    """The member and its text so far (left-stripped, without a tag cut short at its end) of the block that
    a reply stopped at the token limit ended inside: the one `split_reply` calls TRUNCATED; None if none."""
    if finish_reason != "length" or not isinstance(content, str):
        return None
    blocks = _scan(content)
    last = blocks[-1] if blocks else None
    wanted = {i.lower(): i for i in ids}
    if last is None or last.closed or last.end is not None or last.id not in wanted:
        return None
    if sum(1 for b in blocks if b.id == last.id) > 1:
        return None  # DUPLICATED wins
    return wanted[last.id], without_tag_prefix(content[last.start:]).lstrip()


def without_tag_prefix(text: str) -> str:
    """`text` without a tail that may still grow into a response tag (a tag cut short, or about to come)."""
    hold = _TAG_PREFIX.search(text, max(0, text.rfind("<")))
    return text[:hold.start()] if hold is not None else text


def _resolve(
    content: str,
    found: list[_Block],
    key: str,
    wanted: dict[str, str],
    last: _Block | None,
    finish_reason: str | None,
) -> str | BlockFailure:
    if not found:
        return BlockFailure.MISSING
    if len(found) > 1:
        return BlockFailure.DUPLICATED
    block = found[0]
    if not block.closed and block.end is None and block is last and finish_reason == "length":
        # Still open when the reply stopped at the token limit, even if its own tag was cut short.
        return BlockFailure.TRUNCATED
    if block.malformed or not block.closed:
        return BlockFailure.MALFORMED
    text = content[block.start:block.end].strip()
    if not text:
        return BlockFailure.EMPTY
    if any(_mentions(text, other) for other in wanted if other != key):
        return BlockFailure.FOREIGN_ID
    return text


def _scan(content: str) -> list[_Block]:
    """Walk the response tags in order, building blocks and marking the ones that look wrong."""
    scan = _Scan()
    for match in _TAG.finditer(content):
        closing, attrs, gt = match.group(1), match.group(2), match.group(3)
        if closing:
            _close(scan, match, strict=gt is not None and not attrs.strip())
        else:
            _open(scan, match, attrs, complete=gt is not None)
    return scan.blocks


def _open(scan: _Scan, match: re.Match[str], attrs: str, *, complete: bool) -> None:
    if scan.open is not None:
        # A block opened inside another: the outer one never closed properly.
        scan.open.malformed = True
        scan.open.end = match.start()
    strict = _STRICT_ID.fullmatch(attrs) if complete else None
    if strict is not None:
        raw = next(g for g in strict.groups() if g is not None)
        block = _Block(id=raw.strip().lower(), start=match.end())
    else:
        loose = _LOOSE_ID.search(attrs)
        block = _Block(id=loose.group(1).lower() if loose else None, start=match.end(), malformed=True)
    scan.blocks.append(block)
    scan.open = block


def _close(scan: _Scan, match: re.Match[str], *, strict: bool) -> None:
    block = scan.open
    if block is None:
        # A close with nothing open: the previous block's extent is ambiguous.
        if scan.last_closed is not None:
            scan.last_closed.malformed = True
        return
    block.end = match.start()
    block.closed = True
    block.malformed = block.malformed or not strict
    scan.open = None
    scan.last_closed = block


def _mentions(text: str, member_id: str) -> bool:
    """True when `member_id` appears in `text` as a whole token (not inside a longer hex run)."""
    pattern = rf"(?<![0-9a-z]){re.escape(member_id)}(?![0-9a-z])"
    return re.search(pattern, text, re.IGNORECASE) is not None
