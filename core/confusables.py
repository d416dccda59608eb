"""Text as a model may read it: compatibility forms and look-alikes folded to the ASCII they imitate,
invisible characters dropped.

A model reads `＜/request＞` (fullwidth), `﹤/request﹥` (small forms), `</rеquest>` (a Cyrillic `е`) or
`</re\u200bquest>` (a zero-width space inside) as the tag it imitates. Checks that must not be fooled
(the merge prompt's tag neutraliser, the leak check, the simulated model that obeys injections) look
at `fold(text)`: per character NFKC, format characters (Unicode category Cf) and other invisibles
removed, and the common Cyrillic, Greek and angle-bracket homoglyphs mapped to ASCII.
`folded_with_positions` also says where each folded character came from, so a span found in the
folded view can be replaced in the original text, which otherwise stays as its author wrote it.
"""

from __future__ import annotations

import functools
import unicodedata

# Invisible but not category Cf: combining grapheme joiner, Hangul fillers, Khmer inherent vowels,
# Mongolian vowel separator (Cf only in some Unicode versions), braille blank.
_EXTRA_INVISIBLE = frozenset("\u034f\u115f\u1160\u3164\uffa0\u17b4\u17b5\u180e\u2800")

_LOOKALIKES = str.maketrans({
    # Cyrillic
    "а": "a", "в": "b", "е": "e", "ё": "e", "к": "k", "м": "m", "н": "h", "о": "o", "р": "p", "с": "c",
    "т": "t", "у": "y", "х": "x", "ѕ": "s", "і": "i", "ї": "i", "ј": "j", "ԁ": "d", "ԛ": "q", "ԝ": "w",
    "ո": "n", "ս": "u", "ɡ": "g", "ɑ": "a",
    "А": "A", "В": "B", "Е": "E", "К": "K", "М": "M", "Н": "H", "О": "O", "Р": "P", "С": "C", "Т": "T",
    "У": "Y", "Х": "X", "Ѕ": "S", "І": "I", "Ј": "J", "Ԛ": "Q", "Ԝ": "W",
    # Greek
    "α": "a", "ε": "e", "ι": "i", "κ": "k", "ν": "v", "ο": "o", "ρ": "p", "τ": "t", "υ": "u", "χ": "x",
    "Α": "A", "Β": "B", "Ε": "E", "Ζ": "Z", "Η": "H", "Ι": "I", "Κ": "K", "Μ": "M", "Ν": "N", "Ο": "O",
    "Ρ": "P", "Τ": "T", "Υ": "Y", "Χ": "X",
    # Angle brackets and slashes
    "‹": "<", "›": ">", "〈": "<", "〉": ">", "⟨": "<", "⟩": ">", "ᐸ": "<", "ᐳ": ">",
    "˂": "<", "˃": ">", "❮": "<", "❯": ">", "❬": "<", "❭": ">", "《": "<", "》": ">", "«": "<", "»": ">",
    "∕": "/", "⁄": "/", "⧸": "/", "╱": "/",
})


def is_invisible(char: str) -> bool:
    """True for characters a reader does not see: format characters and the few other invisibles."""
    return char in _EXTRA_INVISIBLE or unicodedata.category(char) == "Cf"


@functools.lru_cache(maxsize=4096)
def fold_char(char: str) -> str:
    """What one character reads as: "" if invisible, else its NFKC form with look-alikes mapped to ASCII."""
    if is_invisible(char):
        return ""
    return unicodedata.normalize("NFKC", char).translate(_LOOKALIKES)


def fold(text: str) -> str:
    """`text` as a model may read it (ASCII text comes back unchanged, at once)."""
    if text.isascii():
        return text
    return "".join(fold_char(c) for c in text)


def folded_with_positions(text: str) -> tuple[str, list[int]]:
    """`fold(text)` and, for each of its characters, the index in `text` it came from."""
    if text.isascii():
        return text, list(range(len(text)))
    out: list[str] = []
    origin: list[int] = []
    for index, char in enumerate(text):
        folded = fold_char(char) if not char.isascii() else char
        out.append(folded)
        origin.extend([index] * len(folded))
    return "".join(out), origin
