"""Greedy similarity grouping respects the threshold, the batch size and the token budget, in arrival order."""

from __future__ import annotations

import numpy as np
import pytest

from mergebroker.merge.grouping import group_by_similarity, needs_embedding


def _unit(*rows):
    v = np.array(rows, dtype=np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


# Two topics: items 0, 2, 4 point along x; items 1, 3 along y.
VECTORS = _unit([1, 0.05], [0.02, 1], [1, 0.1], [0.1, 1], [1, 0])


def test_similar_items_group_together_in_arrival_order():
    assert group_by_similarity(VECTORS, threshold=0.9, max_batch=8) == [[0, 2, 4], [1, 3]]


def test_threshold_above_every_similarity_keeps_items_apart():
    assert group_by_similarity(VECTORS, threshold=0.99999, max_batch=8) == [[0], [1], [2], [3], [4]]


def test_similarity_is_measured_against_the_batch_mean():
    # 1 is close to 0 but 2 is close to 1 only; against the mean of {0, 1} it falls below 0.93.
    v = _unit([1, 0], [0.94, 0.34], [0.77, 0.64])
    assert group_by_similarity(v, threshold=0.93, max_batch=8) == [[0, 1], [2]]


def test_max_batch_caps_batches_and_overflow_opens_a_new_one():
    assert group_by_similarity(VECTORS, threshold=0.9, max_batch=2) == [[0, 2], [1, 3], [4]]


def test_budget_caps_the_summed_cost_of_a_batch():
    costs = [40, 10, 70, 10, 30]
    batches = group_by_similarity(VECTORS, threshold=0.9, max_batch=8, costs=costs, budget=100)
    assert batches == [[0, 4], [1, 3], [2]]


def test_item_over_budget_alone_still_gets_a_batch():
    assert group_by_similarity(None, threshold=0, max_batch=4, costs=[500, 1, 1], budget=100) == [[0], [1, 2]]


def test_zero_threshold_fills_batches_in_order_without_similarity():
    assert group_by_similarity(VECTORS, threshold=0, max_batch=2) == [[0, 1], [2, 3], [4]]
    assert group_by_similarity(None, threshold=0.9, max_batch=3, n_items=5) == [[0, 1, 2], [3, 4]]


def test_every_index_appears_exactly_once():
    rng = np.random.default_rng(3)
    v = rng.normal(size=(60, 8))
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    costs = rng.integers(1, 50, size=60).tolist()
    batches = group_by_similarity(v, threshold=0.3, max_batch=5, costs=costs, budget=120)
    assert sorted(i for b in batches for i in b) == list(range(60))
    assert all(b == sorted(b) and len(b) <= 5 for b in batches)
    assert all(sum(costs[i] for i in b) <= 120 for b in batches if len(b) > 1)


def test_mismatched_or_missing_sizes_are_rejected():
    with pytest.raises(ValueError):
        group_by_similarity(VECTORS, threshold=0.5, max_batch=2, costs=[1, 2])
    with pytest.raises(ValueError):
        group_by_similarity(None, threshold=0.5, max_batch=2)


def test_needs_embedding_only_for_groups_with_a_positive_threshold():
    assert needs_embedding(3, 0.8)
    assert not needs_embedding(1, 0.8)
    assert not needs_embedding(3, 0.0)
