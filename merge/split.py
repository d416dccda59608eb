"""Split a merged reply into the members' answers, by ID and never by position.

The reply is scanned for tags of the ID's shape (`<K42>`, `</K42>`: `merge.prompt.ID_PATTERN`, any case,
spaces after `/` and before `>`). A block opens with its ID's tag and closes with the same ID's closing tag.
Chatter outside blocks is ignored, blocks may come in any order, and a block whose ID belongs to no
member is never routed to anyone. Every member gets either its stripped answer or a `BlockFailure`.
When in doubt the parser reports a failure: a failed member falls back to its own upstream call,
while a wrongly routed answer would be a silent bug.

Failures, in order of precedence for one ID:
    DUPLICATED  the ID opens more than one block
    TRUNCATED   the reply ends inside the block (the last one) and finish_reason is "length"
    MALFORMED   a garbled or nested tag inside, around or for the block, a block closed by another ID's tag,
                or a block never closed
    EMPTY       the block holds only whitespace
    FOREIGN_ID  the block mentions another member's ID
    MISSING     no block for the ID
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from mergebroker.merge.prompt import ID_PATTERN


class BlockFailure(enum.Enum):
    """Why a member got no answer out of a merged reply."""

    MISSING = "missing"
    EMPTY = "empty"
    DUPLICATED = "duplicated"
    MALFORMED = "malformed"
    TRUNCATED = "truncated"
    FOREIGN_ID = "foreign_id"


# Anything that starts like a tag of the ID's shape; [^<>]* cannot backtrack badly and stops at the next tag.
# No space after "<" (spaces may follow "/"): "a < b12" in an answer is arithmetic, not a tag.
_TAG = re.compile(rf"<(?:(/)\s*)?({ID_PATTERN})(?![0-9a-z])([^<>]*)(>)?", re.IGNORECASE)
# A tail that may still become a tag: "<", "</ ", "<K", "<K4", "<K42 junk" (no ">" yet).
_TAG_PREFIX = re.compile(r"<(?:/\s*)?(?:[a-z](?:[0-9]+|[0-9]{2,}[^0-9a-z<>][^<>]*)?)?\Z", re.IGNORECASE)
_ID_RUN = re.compile(r"[0-9a-z]+", re.IGNORECASE)


@dataclass(frozen=True)
class Tag:
    """One tag found by `tags`: its member ID (lower-case), whether it closes, and whether it is clean
    (ends with `>` and carries nothing but spaces besides its ID)."""

    id: str
    closing: bool
    clean: bool


def tags(content: str, start: int = 0, end: int | None = None) -> Iterator[tuple[re.Match[str], Tag]]:
    """Every tag of the ID's shape in `content[start:end]`, in order, with the match it came from."""
    for match in _TAG.finditer(content, start, len(content) if end is None else end):
        closing, name, attrs, gt = match.groups()
        yield match, Tag(name.lower(), bool(closing), gt is not None and not attrs.strip())


class IdMentions:
    """Which member IDs a text names as a whole token (not inside a longer run of letters and digits).

    Built once per reply: one scan of a text's letter-and-digit runs against a set of IDs, so checking a
    block against thousands of members costs one pass rather than one regex per member.
    """

    def __init__(self, ids: Iterable[str]) -> None:
        self._ids = {i.casefold() for i in ids}

    def others(self, text: str, own: str) -> bool:
        """True when `text` names an ID of the set other than `own`."""
        own = own.casefold()
        return any(run != own and run in self._ids for run in (m.group().casefold() for m in _ID_RUN.finditer(text)))


@dataclass
class _Block:
    """One opened block while scanning (`id` lower-case)."""

    id: str
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
    mentions = IdMentions(wanted)
    result: dict[str, str | BlockFailure] = {}
    for key, original in wanted.items():
        found = by_id.get(key, [])
        result[original] = _resolve(content, found, key, mentions, last, finish_reason)
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
    """`text` without a tail that may still grow into a tag (a tag cut short, or about to come)."""
    hold = _TAG_PREFIX.search(text, max(0, text.rfind("<")))
    return text[:hold.start()] if hold is not None else text


def _resolve(
    content: str,
    found: list[_Block],
    key: str,
    mentions: IdMentions,
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
    if mentions.others(text, key):
        return BlockFailure.FOREIGN_ID
    return text


def _scan(content: str) -> list[_Block]:
    """Walk the tags in order, building blocks and marking the ones that look wrong."""
    scan = _Scan()
    for match, tag in tags(content):
        if tag.closing:
            _close(scan, match, tag)
        else:
            _open(scan, match, tag)
    return scan.blocks


def _open(scan: _Scan, match: re.Match[str], tag: Tag) -> None:
    if scan.open is not None:
        # A block opened inside another: the outer one never closed properly.
        scan.open.malformed = True
        scan.open.end = match.start()
    block = _Block(id=tag.id, start=match.end(), malformed=not tag.clean)
    scan.blocks.append(block)
    scan.open = block


def _close(scan: _Scan, match: re.Match[str], tag: Tag) -> None:
    block = scan.open
    if block is None:
        # A close with nothing open: the previous block's extent is ambiguous.
        if scan.last_closed is not None:
            scan.last_closed.malformed = True
        return
    block.end = match.start()
    block.closed = True
    block.malformed = block.malformed or not tag.clean or tag.id != block.id
    scan.open = None
    scan.last_closed = block
