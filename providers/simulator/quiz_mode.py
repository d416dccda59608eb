"""The simulated upstream's quiz mode and merge degradation (pure), to prove merge-quality tooling.

- `quiz`: a question of the built-in set (`providers.simulator.quiz_set`) is answered with its computed answer, alone
  and inside a merged call, so an evaluation of the set scores 100% alone.
- `merge_degrade` (0..1): in a merged call of `n` blocks, each block's answer is wrong with probability
  `min(1, merge_degrade * (n - 1))`: it gets the next block's answer instead, as a model that mixes up
  batched questions would. Alone (n = 1) nothing degrades. The draw is a hash of the question, not the
  RNG, so the same question fails the same way on every run, and a question wrong in a batch of 2 is
  wrong in every larger batch too (accuracy falls monotonically with batch size).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from mergebroker.providers.simulator.quiz_set import solve


def quiz_answer(question: str, answer: str) -> str:
    """The computed answer when `question` is in the built-in set, else `answer`."""
    solved = solve(question)
    return answer if solved is None else solved


def degrade_probability(batch_size: int, degrade: float) -> float:
    """The chance that one block of a merged call of `batch_size` blocks gets a wrong answer."""
    return min(1.0, max(0.0, degrade) * max(0, batch_size - 1))


def is_degraded(question: str, batch_size: int, degrade: float) -> bool:
    """Whether this question's block is answered wrongly in a merged call of `batch_size` blocks."""
    digest = hashlib.sha256(" ".join(question.split()).lower().encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64 < degrade_probability(batch_size, degrade)


def merged_answers(blocks: Sequence[tuple[str, str]], answers: Sequence[tuple[str, str]], *, quiz: bool,
                   degrade: float) -> list[tuple[str, str]]:
    """The (id, answer) of every block of a merged call with quiz answers and degradation applied.

    `blocks` are the (id, question) pairs and `answers` the simulator's usual (id, answer) pairs, in order.
    """
    texts = [quiz_answer(q, a) if quiz else a for (_, q), (_, a) in zip(blocks, answers)]
    out = []
    for index, (block_id, question) in enumerate(blocks):
        text = texts[index]
        if len(blocks) > 1 and is_degraded(question, len(blocks), degrade):
            neighbour = texts[(index + 1) % len(texts)]
            text = neighbour if neighbour != text else text + " (or so)"
        out.append((block_id, text))
    return out
