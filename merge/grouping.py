"""Group pending requests into merge batches by meaning: greedy, in arrival order, deterministic.

Each item joins the first open batch that (a) is similar enough, i.e. the cosine between the item and
the batch's mean vector is above `threshold`, (b) has fewer than `max_batch` members and (c) stays
within the token `budget` with the item's cost added; otherwise it opens a new batch. With
`threshold <= 0` (or no vectors) similarity is not consulted and items simply fill batches in order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def needs_embedding(n_items: int, threshold: float) -> bool:
    """True when grouping `n_items` at `threshold` consults similarity, so vectors must be computed."""
    return n_items > 1 and threshold > 0


def group_by_similarity(
    vectors: np.ndarray | None,
    *,
    threshold: float,
    max_batch: int,
    costs: Sequence[int] | None = None,
    budget: int | None = None,
    n_items: int | None = None,
) -> list[list[int]]:
    """Return batches of item indices; every index appears in exactly one batch, in arrival order.

    `vectors` has one L2-normalised row per item (shape (n, d)); `costs` (e.g. prompt plus output
    tokens) is summed per batch and kept within `budget`; an item that alone exceeds the budget gets a
    batch of its own. `n_items` gives the count when neither `vectors` nor `costs` is passed.
    """
    if max_batch < 1:
        raise ValueError("max_batch must be at least 1")
    n = _item_count(vectors, costs, n_items)
    similar = vectors if vectors is not None and threshold > 0 else None  # None: group by count and cost only
    item_costs = list(costs) if costs is not None else [0] * n
    batches: list[list[int]] = []
    totals: list[int] = []
    sums: list[np.ndarray] = []
    for item in range(n):
        for b, members in enumerate(batches):
            if len(members) >= max_batch:
                continue
            if budget is not None and totals[b] + item_costs[item] > budget:
                continue
            if similar is not None and _cosine(similar[item], sums[b]) <= threshold:
                continue
            members.append(item)
            totals[b] += item_costs[item]
            if similar is not None:
                sums[b] = sums[b] + similar[item]
            break
        else:
            batches.append([item])
            totals.append(item_costs[item])
            if similar is not None:
                sums.append(np.array(similar[item], dtype=np.float64))
    return batches


def _item_count(vectors: np.ndarray | None, costs: Sequence[int] | None, n_items: int | None) -> int:
    counts: set[int] = set()
    if vectors is not None:
        if vectors.ndim != 2:
            raise ValueError("vectors must have shape (n, d)")
        counts.add(vectors.shape[0])
    if costs is not None:
        counts.add(len(costs))
    if n_items is not None:
        counts.add(n_items)
    if len(counts) != 1:
        raise ValueError("pass vectors, costs or n_items, with matching lengths")
    return counts.pop()


def _cosine(vector: np.ndarray, batch_sum: np.ndarray) -> float:
    # The mean's direction is the sum's direction, so renormalising the sum is enough.
    denominator = float(np.linalg.norm(vector) * np.linalg.norm(batch_sum))
    return float(np.dot(vector, batch_sum)) / denominator if denominator > 0 else 0.0
