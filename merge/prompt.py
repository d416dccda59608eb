"""Build the combined prompt of a merged call (the wire format in docs/architecture.md).

The group's system message is kept unchanged and one user message carries a header and one `<ID>...</ID>`
block per member, where ID is a tag name drawn fresh per call (`K42`: a consonant and two digits). The model
answers in blocks of the same form. The format is terse because every member pays its tags: 6.0 input and 6.9
output tokens under o200k_base, against 11.7 and 12.7 for the former `<request id="3fa9c1">` blocks (built-in
quiz questions in calls of 4).

Member text is neutralised first (`neutralize_tags`, on the text as a model reads it): every tag of the ID's
shape, whatever its ID, is rewritten, so no member can close its own block or forge another's even if it
guessed an ID. This module also owns the parsing helpers of the format (`request_blocks`, `response_block`),
so test fakes that play the model share them instead of copying its regexes.
"""

from __future__ import annotations

import functools
import random
import re
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mergebroker.confusables import fold, folded_with_positions

# The header shows the block only with the placeholder `<ID>`, which is not of the ID's shape: a real tag
# here would look like one more block to anyone parsing the combined prompt (the simulated upstream does).
# It does not say how many requests follow, so it is the same for every merged call: the provider's prompt
# cache keeps the system prompt and the header as one prefix across calls of any size.
DEFAULT_HEADER = (
    "Independent requests follow, each wrapped in a tag that is its id, like <ID>request</ID>. "
    "Answer each one separately and completely, as if it had been asked alone. "
    "Never mention, quote or use the other requests in an answer. "
    "Reply only with the answers, each wrapped in its request's tag, like <ID>answer</ID>, in any order."
)
TAGGED_HEADER = DEFAULT_HEADER + (
    " A request may start with a system section: follow it as the system instructions for that "
    "request only."
)

# Consonants (no ID spells a word) whose tags cost the fewest tokens: `<K42>` is 3 tokens, `</K42>` 4, while
# Y and Z cost one more. Two digits give 1,800 IDs a call; a call of more than 100 members gets longer IDs.
_ID_LETTERS = "BCDFGHJKMNPQRSTVWX"
_ID_DIGITS = 2
_MANY_MEMBERS = 100
ID_PATTERN = r"[a-z][0-9]{2,}"
"""An ID as the parsers read it (case-insensitive): a letter and two or more digits. `new_batch_ids` draws
a subset of these; anything of this shape in member text is neutralised."""
_ID_TOKEN = re.compile(r"(?<![0-9a-z])[a-z][0-9]{2,}(?![0-9a-z])", re.IGNORECASE)
_BLOCK_TAGS: tuple[str, ...] = ()
_TAGGED_TAGS = ("system",)


@dataclass(frozen=True)
class MergeMember:
    """One member of a merged call: its batch ID, its question, its own token budget and,
    in tagged mode only, its own system prompt."""

    id: str
    user_text: str
    max_tokens: int
    system_prompt: str | None = None


def new_batch_ids(n: int, rng: random.Random | None = None, *, avoid: Iterable[str] = ()) -> list[str]:
    """Return `n` distinct IDs, an upper-case consonant and two digits (`K42`; more digits for calls of over
    100 members, so the draw never fills its space), from `secrets` unless `rng` is given.

    Drawn fresh per call; guessing one is not what stops a forgery (`neutralize_tags` rewrites every tag of
    the ID's shape in member text), but it keeps one call's IDs from meaning anything in the next. No ID is
    drawn that any text in `avoid` (the members' questions and system prompts) names as a token: answers
    echo their prompts, and an answer naming another member's ID ("vitamin B12") is refused by the split
    and sent again alone.
    """
    if n < 0:
        raise ValueError("n must not be negative")
    digits = _ID_DIGITS if n <= _MANY_MEMBERS else len(str(n)) + 1
    choice = rng.choice if rng is not None else secrets.choice
    taken = {run.upper() for text in avoid for run in _ID_TOKEN.findall(text)}
    if len(taken) > len(_ID_LETTERS) * 10 ** digits // 2:
        digits += 1  # texts that name most of the space: longer IDs rather than a long draw
    ids: list[str] = []
    while len(ids) < n:
        new = choice(_ID_LETTERS) + "".join(choice("0123456789") for _ in range(digits))
        if new not in taken:
            taken.add(new)
            ids.append(new)
    return ids


def neutralize_tags(text: str, tags: Sequence[str] = _BLOCK_TAGS) -> str:
    """Rewrite every opening or closing tag of the ID's shape (`<K42>`, `</b17>`, any ID) in `text` so that
    no model reads it as one.

    Tags are found in the text as a model reads it (`mergebroker.confusables.fold`: look-alikes such as
    `＜/K42＞`, `﹤/K42﹥`, a Cyrillic `К` or fullwidth digits, invisible characters inside, any case, spaces
    or separators between the characters, and the escapes `&lt;`, `&#60;`, `&#x3c;`), and each is replaced
    in the original by the same name in square brackets, `[/k42]`: readable, but not the angle-bracket form
    the header defines. The rest of the text is left exactly as written. `tags` adds named tags (tagged
    mode adds `system`).
    """
    pattern = _tag_pattern(tuple(tags))
    view = fold(text)
    if pattern.search(view) is None:
        return text
    view, origin = folded_with_positions(text)
    pieces: list[str] = []
    kept = 0
    for match in pattern.finditer(view):
        start, end = origin[match.start()], origin[match.end() - 1] + 1
        pieces += [text[kept:start], f"[{'/' if match.group(1) else ''}{_UNSPACE.sub('', match.group(2)).lower()}]"]
        kept = end
    return "".join([*pieces, text[kept:]])


def build_combined_messages(
    members: Sequence[MergeMember],
    *,
    system_prompt: str | None,
    header: str | None = None,
    tagged_system: bool = False,
) -> list[dict[str, Any]]:
    """Return the messages of the merged call: the system message (if any), then the combined user message.

    `header` is a template with `{n}`; None means `DEFAULT_HEADER` (`TAGGED_HEADER` in tagged mode).
    In tagged mode (`tagged_system=True`) no shared system message is sent and `system_prompt` is
    ignored: each block starts with its member's own `<system>` section instead.
    """
    if not members:
        raise ValueError("a merged call needs at least one member")
    if len({m.id for m in members}) != len(members):
        raise ValueError("member ids must be distinct")
    if header is None:
        header = TAGGED_HEADER if tagged_system else DEFAULT_HEADER
    blocks = [_request_block(m, tagged_system) for m in members]
    messages: list[dict[str, Any]] = []
    if system_prompt is not None and not tagged_system:
        messages.append({"role": "system", "content": system_prompt})
    # str.replace rather than str.format: an operator's header may contain other braces.
    intro = header.replace("{n}", str(len(members)))
    messages.append({"role": "user", "content": intro + "\n\n" + "\n".join(blocks)})
    return messages


# Left out of a merged call's body: the members' own budgets and `user` (the merged call has its own), and
# `stop`, which is applied to each member's answer after the split: met in one answer it would cut every
# later block.
_PER_MEMBER_BODY_FIELDS = ("max_tokens", "max_completion_tokens", "user", "stop")
BLOCK_OVERHEAD_TOKENS = 7
"""Output tokens a response block's tags cost beyond its answer, `TAG_SLACK_TOKENS` included: `<K42>`, `</K42>`
and a newline are 6 under o200k_base for every ID `new_batch_ids` draws (the former `<response id="3fa9c1">`
blocks cost 12); `response_tag_tokens` counts one block's exactly, tests/merge/test_prompt.py measures the mean."""
TAG_SLACK_TOKENS = 1
"""Room for one more separator token than the block's own format (a model that puts a blank line between
blocks)."""


def response_tag_tokens(member_id: str, count_tokens: Callable[[str], int]) -> int:
    """Output tokens member `member_id`'s response block costs beyond its answer: its tags as the header asks
    for them, with the separators around them, plus `TAG_SLACK_TOKENS`."""
    return count_tokens(response_block(member_id, "") + "\n") + TAG_SLACK_TOKENS


def merged_request_body(template: Mapping[str, Any], members: Sequence[MergeMember], *, system_prompt: str | None,
                        header: str | None = None, tagged_system: bool = False,
                        count_tokens: Callable[[str], int] | None = None,
                        output_limit: int | None = None) -> dict[str, Any]:
    """The body of a merged call: `template` (the first member's body: model, sampling, every shared field)
    with the combined messages and a token budget that fits every member's own in place of the member's.

    The budget is the members' budgets plus their blocks' tags, so no block is cut by the merged call's
    limit before its member reached its own: counted with `count_tokens` (the broker's tokenizer), or
    `BLOCK_OVERHEAD_TOKENS` per block without one. It never exceeds `output_limit` (the model's most output
    tokens, where known): planners size batches with average tags, and a few tokens of exact tags must not
    make the provider refuse the call; a block the limit cuts short ends `length` where its member reached
    its own budget, and goes again alone otherwise.
    """
    body = {k: v for k, v in template.items() if k not in _PER_MEMBER_BODY_FIELDS}
    body["messages"] = build_combined_messages(members, system_prompt=system_prompt, header=header,
                                               tagged_system=tagged_system)
    if count_tokens is None:
        budget = merged_max_tokens(members, model_limit=None, per_member_overhead=BLOCK_OVERHEAD_TOKENS)
    else:
        budget = sum(m.max_tokens + response_tag_tokens(m.id, count_tokens) for m in members)
    body["max_tokens"] = budget if output_limit is None else min(budget, output_limit)
    return body


def merged_max_tokens(
    members: Sequence[MergeMember], *, model_limit: int | None, per_member_overhead: int = 0
) -> int:
    """Token budget of the merged call: the members' budgets (plus an optional per-block overhead for
    the response tags) summed, capped by the model's output limit."""
    total = sum(m.max_tokens + per_member_overhead for m in members)
    return total if model_limit is None else min(total, model_limit)


def response_block(member_id: str, answer: str) -> str:
    """One block of a merged reply as the header asks for it (what fakes that play the model answer)."""
    return f"<{member_id}>{answer}</{member_id}>"


def request_blocks(content: str) -> list[tuple[str, str]]:
    """The (ID, text) of every block of a combined user message as `build_combined_messages` writes it, in
    order; in tagged mode the text starts with its `<system>` section. For fakes and tests that read merged
    calls: what a model sees is the simulated upstream's business (`providers.simulator.injection`)."""
    return [(m.group(1), m.group(2)) for m in _REQUEST_BLOCK.finditer(content)]


def _request_block(member: MergeMember, tagged_system: bool) -> str:
    tags = _TAGGED_TAGS if tagged_system else _BLOCK_TAGS
    body = neutralize_tags(member.user_text, tags)
    if tagged_system and member.system_prompt is not None:
        body = f"<system>{neutralize_tags(member.system_prompt, tags)}</system>\n{body}"
    return f"<{member.id}>{body}</{member.id}>"


_OPEN = r"(?:<|&lt;?|&#0*60;?|&#x0*3c;?)"
_CLOSE = r"(?:>|&gt;?|&#0*62;?|&#x0*3e;?)"
_SEPARATORS = r"[\s._\-]*"
_UNSPACE = re.compile(_SEPARATORS)
# The ID's shape with separators allowed between its characters: `< K 4_2 >` reads as a tag to a model.
_SPACED_ID = rf"[a-z](?:{_SEPARATORS}[0-9]){{2,}}"
_REQUEST_BLOCK = re.compile(rf"<({ID_PATTERN})>(.*?)</\1>", re.DOTALL | re.IGNORECASE)


@functools.lru_cache(maxsize=8)
def _tag_pattern(tags: tuple[str, ...]) -> re.Pattern[str]:
    # Group 1: the closing slash; group 2: the name (an ID of any value, or a named tag; characters may be
    # spaced out); then, within a short reach, the attributes up to the tag's end, which go too.
    names = "|".join([_SPACED_ID, *(_SEPARATORS.join(re.escape(letter) for letter in t) for t in tags)])
    return re.compile(rf"{_OPEN}\s*(/\s*)?({names})(?![a-z0-9])(?:[^<>]{{0,120}}?{_CLOSE})?", re.IGNORECASE)
