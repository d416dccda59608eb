"""Model names become metric labels only up to a bound; every later name shares the label "other"."""

from __future__ import annotations

from mergebroker.broker.engine.ground.metrics import MAX_MODEL_LABELS, Metrics


def test_the_first_distinct_model_names_are_their_own_labels_and_later_ones_are_other() -> None:
    metrics = Metrics(max_model_labels=2)
    assert [metrics.model_label(m) for m in ("a", "b", "c", "a", "d", "b")] == ["a", "b", "other", "a", "other", "b"]


def test_the_default_bound_admits_200_models() -> None:
    metrics = Metrics()
    labels = [metrics.model_label(f"m{n}") for n in range(MAX_MODEL_LABELS + 50)]
    assert MAX_MODEL_LABELS == 200
    assert labels[:MAX_MODEL_LABELS] == [f"m{n}" for n in range(MAX_MODEL_LABELS)]
    assert set(labels[MAX_MODEL_LABELS:]) == {"other"}


def test_each_metrics_instance_keeps_its_own_model_labels() -> None:
    first, second = Metrics(max_model_labels=1), Metrics(max_model_labels=1)
    assert first.model_label("a") == "a"
    assert second.model_label("b") == "b" and first.model_label("b") == "other"
