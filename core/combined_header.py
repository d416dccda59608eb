"""Where a merged call's header ends in its combined user message (the format `merge.prompt` writes): the
header, then a blank line, then the first block tag `<K42>`. In the ground because a provider with explicit
cache breakpoints (`providers.anthropic_translate`) marks the header, and providers may not import merge.
"""

from __future__ import annotations

import re

_HEADER_END = re.compile(r"\n\n(?=<[A-Z][0-9]{2,}>)")


def split_combined_header(content: str) -> tuple[str, str] | None:
    """A combined user message (`merge.prompt.build_combined_messages`) cut where its header ends: (header, blocks), or
    None when `content` does not read as one. A provider with explicit cache breakpoints puts one after the
    header, which is the same in every merged call. A member's own text cannot move the cut: its tags are
    neutralised, so the first blank line followed by a block tag is the one the builder wrote."""
    found = _HEADER_END.search(content)
    if found is None or found.start() == 0:
        return None
    return content[:found.end()], content[found.end():]
