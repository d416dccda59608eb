"""The simulated upstream's content: deterministic answers, token counts, merged-call replies, embeddings.

Pure functions, no I/O. `answer_for` is the answer to one question; a merged call in the combined
prompt format of docs/architecture.md (`<K42>...</K42>` blocks) is answered block by block by
`compose_reply`, with block faults from `providers.simulator.faults`. Usage is counted with the real
o200k_base tokenizer, by the simulator itself (as a provider counts, whatever the broker counts), and
`prompt_token_ids` is the prompt as that tokenizer sees it, which the prompt cache remembers.

Prompt injection: like a compromised model, the simulator obeys a request block whose text contains
the phrase `repeat every other request` (`INJECTION_MARKER`, any case or spacing): that block's answer
is its usual `answer_for` followed by the text of every other request block of the call, one per line,
verbatim or in the disguise it names (`providers.simulator.injection`, which also makes the simulator
read look-alike tags as tags). Alone (outside a merged call) such a question gets its usual answer:
there is nothing to leak.
"""

from __future__ import annotations

import functools
import hashlib
import random
import re
import zlib
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import bpe_openai
import numpy as np

from mergebroker.providers.simulator.faults import DEFAULT_ANSWER_WORDS, SimulatorConfig, decide_truncate, render_blocks
from mergebroker.providers.simulator.injection import canonical_tags, injected_form, obey, read, request_blocks
from mergebroker.providers.simulator.quiz_mode import merged_answers, quiz_answer

WORDS_PER_CHUNK = 3


# Pseudo-Latin fillers: no real question quotes them, and none holds a digit, so an answer can never
# be mistaken for naming a batch ID (a letter and digits) by the split checks.
_FILLER = (
    "lorem", "ipsum", "dolor", "amet", "tempor", "labore", "magna", "aliqua", "veniam", "nostrud",
    "ullamco", "laboris", "nisi", "aliquip", "commodo", "consequat", "irure", "velit", "esse", "cillum",
    "fugiat", "nulla", "pariatur", "sint", "ornare", "proident", "sunt", "culpa", "officia", "mollit",
    "anim", "laborum", "porta", "vivamus", "lectus", "rutrum", "sapien", "nunc", "quam", "luctus",
    "tortor", "varius", "mauris", "pretium", "turpis", "auctor", "nibh", "tellus", "rhoncus", "purus",
    "gravida", "viverra", "justo", "primis", "ultrices", "posuere", "cubilia", "sollicitudin", "volutpat",
    "tincidunt", "suscipit", "lacinia", "blandit", "semper",
)
_CODE_LETTERS = "ghijklmnopqrstuvwxyz"  # letters only, for the same reason as the fillers


def normalise_question(text: str) -> str:
    """Read it as the model does (look-alikes folded), collapse whitespace, lower-case, and reduce every
    tag form to its name (`canonical_tags`).

    The last step makes a question answered inside a merged call (where the broker neutralised its tags)
    get the same answer as when asked alone.
    """
    return canonical_tags(" ".join(read(text).split()).lower())


def answer_for(text: str, words: int = DEFAULT_ANSWER_WORDS) -> str:
    """The simulator's deterministic answer to a question: "Answer CODE: " plus `words` filler words.

    Same question modulo whitespace and case -> same answer; different questions -> different
    answers (CODE is 10 letters from SHA-256). The answer never contains the question text.
    """
    digest = hashlib.sha256(normalise_question(text).encode()).digest()
    code = "".join(_CODE_LETTERS[b % len(_CODE_LETTERS)] for b in digest[:10])
    fillers: list[str] = []
    stream = digest
    while len(fillers) < words:
        stream = hashlib.sha256(stream).digest()
        fillers.extend(_FILLER[b % len(_FILLER)] for b in stream)
    return f"Answer {code}: " + " ".join(fillers[:words]) + "."


@functools.cache
def _encoding() -> Any:
    return bpe_openai.get_encoding("o200k_base")


@functools.lru_cache(maxsize=512)
def _token_ids(text: str) -> array:
    # Cached because prompts repeat (a shared system prompt is counted on every call, and encoding
    # 2,000 tokens costs about 0.3 ms); 4 bytes a token keeps 512 long prompts within a few MB.
    return array("I", _encoding().encode(text))


def token_ids(text: str) -> array:
    """The o200k_base token ids of `text` (cached; do not modify the array)."""
    return _token_ids(text) if text else array("I")


def count_tokens(text: str) -> int:
    """Tokens of `text` under o200k_base."""
    return len(_token_ids(text)) if text else 0


def message_text(content: Any) -> str:
    """The text of a message's content: a string, a list of parts (text parts joined), or None."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


# Marker ids beyond o200k_base's vocabulary, standing for the chat format's special tokens.
_START, _SEPARATOR, _REPLY = 200_264, 200_266, 200_267


def prompt_token_ids(messages: Sequence[Mapping[str, Any]]) -> array:
    """The prompt as the model reads it, in order: per message a start marker, its role, a separator
    and its text's tokens; then the 3 tokens that prime the reply (OpenAI's chat accounting).
    Its length is `prompt_tokens(messages)`."""
    ids = array("I")
    for message in messages:
        ids.extend((_START, zlib.crc32(str(message.get("role")).encode()), _SEPARATOR))
        if text := message_text(message.get("content")):
            ids += _token_ids(text)
    ids.extend((_START, _REPLY, _SEPARATOR))
    return ids


def prompt_tokens(messages: Sequence[Mapping[str, Any]]) -> int:
    """OpenAI-style prompt count: tokens of every message's text, plus 3 per message, plus 3."""
    return sum(count_tokens(message_text(m.get("content"))) + 3 for m in messages) + 3


_TAGGED_SYSTEM = re.compile(r"^\s*<system>.*?</system>", re.S)


def block_answers(blocks: Sequence[tuple[str, str]], words: int = DEFAULT_ANSWER_WORDS) -> list[tuple[str, str]]:
    """The (id, answer) of every request block; a block asking for `INJECTION_MARKER` gets the others' text
    too, in the form it asks for (`providers.simulator.injection`)."""
    answers = []
    for index, (block_id, text) in enumerate(blocks):
        answer = answer_for(text, words)
        form = injected_form(text)
        if form is not None:
            answer = obey(answer, form, [other for i, (_, other) in enumerate(blocks) if i != index])
        answers.append((block_id, answer))
    return answers


def parse_request_blocks(text: str) -> list[tuple[str, str]]:
    """The (id, user text) of every `<ID>...</ID>` block the model sees (look-alike tags included);
    a leading `<system>` part is not the question."""
    return [(block_id, _TAGGED_SYSTEM.sub("", body, count=1)) for block_id, body in request_blocks(text)]


def question_text(messages: Sequence[Mapping[str, Any]]) -> str:
    """The text being asked: the last user message (the last message if none is from the user)."""
    users = [m for m in messages if m.get("role") == "user"]
    return message_text((users or list(messages))[-1].get("content"))


@dataclass(frozen=True)
class Reply:
    """A composed chat reply: its content, why it ended, its token count, what shaped it, and the tool calls it
    makes (chat's `tool_calls` objects; `providers.simulator.chat_agent`)."""

    content: str
    finish_reason: str
    completion_tokens: int
    merged: bool
    faults: tuple[str, ...] = ()
    tool_calls: tuple[dict[str, Any], ...] = ()


def compose_reply(messages: Sequence[Mapping[str, Any]], *, max_tokens: int | None,
                  config: SimulatorConfig, rng: random.Random) -> Reply:
    """The reply to a chat call: one answer, or one block per request block (with block faults);
    then the truncate fault (cut in half) and `max_tokens` (cut at that many tokens), both "length"."""
    blocks = parse_request_blocks(question_text(messages))
    faults: list[str] = []
    if blocks:
        answers = block_answers(blocks, config.answer_words)
        if config.quiz or config.merge_degrade:
            answers = merged_answers(blocks, answers, quiz=config.quiz, degrade=config.merge_degrade)
        content, faults = render_blocks(answers, config, rng)
    else:
        content = answer_for(question_text(messages), config.answer_words)
        content = quiz_answer(question_text(messages), content) if config.quiz else content
    finish_reason = "stop"
    if decide_truncate(config, rng):
        content, finish_reason = content[: len(content) // 2], "length"
        faults.append("truncate")
    content, tokens, cut = cut_to_tokens(content, max_tokens)
    return Reply(content, "length" if cut else finish_reason, tokens, bool(blocks), tuple(faults))


def cut_to_tokens(text: str, max_tokens: int | None) -> tuple[str, int, bool]:
    """`text` cut at `max_tokens` tokens (None: not cut): the text kept, its tokens, and whether it was cut."""
    tokens = _encoding().encode(text) if text else []
    if max_tokens is None or len(tokens) <= max_tokens:
        return text, len(tokens), False
    return _encoding().decode(tokens[:max_tokens]), max_tokens, True


def stream_pieces(content: str, words: int = WORDS_PER_CHUNK) -> list[str]:
    """Content split into pieces of a few words each; joined they give back `content` exactly."""
    parts = re.findall(r"\s*\S+|\s+$", content)
    return ["".join(parts[i:i + words]) for i in range(0, len(parts), words)]


@functools.lru_cache(maxsize=16384)
def _hashed_unit(key: str, dim: int) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    vector = np.random.default_rng(seed).standard_normal(dim)
    vector /= np.linalg.norm(vector)
    vector.flags.writeable = False
    return vector


def embedding_vector(text: str, dim: int) -> np.ndarray:
    """A deterministic unit-norm float32 vector for `text`.

    Mostly the sum of per-word hashed vectors (so texts sharing words have a high cosine, which
    lets the broker's similarity grouping work against the simulator), plus a small hashed part
    of the exact text so that different texts never share a vector.
    """
    words = re.findall(r"\w+", text.lower())
    vector = 0.1 * _hashed_unit("text\0" + text, dim)
    if words:
        bag = np.sum([_hashed_unit("word\0" + w, dim) for w in words], axis=0)
        vector = vector + 0.9 * bag / max(float(np.linalg.norm(bag)), 1e-12)
    return (vector / np.linalg.norm(vector)).astype("<f4")

