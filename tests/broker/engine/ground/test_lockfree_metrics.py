"""The lock-free families export exactly what prometheus_client's own families export for the same counts."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import metrics as prometheus_metrics

from mergebroker.broker.engine.ground.lockfree_metrics import LockFreeCounter, LockFreeHistogram
from mergebroker.broker.engine.ground.metrics import LATENCY_BUCKETS, Metrics, preinitialise

_CREATED = re.compile(r"^(\S+_created(?:\{[^}]*\})?) \S+$", re.M)


def _exposition(registry: CollectorRegistry) -> str:
    """The text exposition with each `_created` timestamp blanked (they differ between any two families)."""
    return _CREATED.sub(r"\1 T", generate_latest(registry).decode())


def _count(counter: object, histogram: object, plain: object) -> None:
    counter.labels("chat", "standard").inc()  # type: ignore[attr-defined]
    counter.labels(endpoint="chat", tier="standard").inc(2.5)  # type: ignore[attr-defined]
    counter.labels("embeddings", "batch").inc(0)  # type: ignore[attr-defined]
    for value in (0.0005, 0.001, 0.003, 7.0, 99.0):
        histogram.labels("chat").observe(value)  # type: ignore[attr-defined]
    histogram.labels("idle")  # type: ignore[attr-defined]
    plain.inc(3)  # type: ignore[attr-defined]


def _pair() -> tuple[str, str]:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    _count(LockFreeCounter("x_requests", "Requests.", ["endpoint", "tier"], registry=ours),
           LockFreeHistogram("x_latency_seconds", "Latency.", ["tier"], buckets=LATENCY_BUCKETS, registry=ours),
           LockFreeCounter("x_saved", "Saved.", registry=ours))
    _count(Counter("x_requests", "Requests.", ["endpoint", "tier"], registry=theirs),
           Histogram("x_latency_seconds", "Latency.", ["tier"], buckets=LATENCY_BUCKETS, registry=theirs),
           Counter("x_saved", "Saved.", registry=theirs))
    return _exposition(ours), _exposition(theirs)


@pytest.mark.parametrize("use_created", [True, False])
def test_the_exposition_is_prometheus_clients_own(monkeypatch: pytest.MonkeyPatch, use_created: bool) -> None:
    monkeypatch.setattr(prometheus_metrics, "_use_created", use_created)
    ours, theirs = _pair()
    assert ours == theirs
    assert ("_created" in ours) is use_created


def test_sample_values_read_back_through_the_registry() -> None:
    registry = CollectorRegistry()
    histogram = LockFreeHistogram("x_wait_seconds", "Wait.", ["tier"], buckets=(0.1, 1.0), registry=registry)
    histogram.labels("std").observe(0.1)  # on a bound: counted in that bucket (le is "less or equal")
    histogram.labels("std").observe(5.0)
    assert registry.get_sample_value("x_wait_seconds_bucket", {"tier": "std", "le": "0.1"}) == 1.0
    assert registry.get_sample_value("x_wait_seconds_bucket", {"tier": "std", "le": "+Inf"}) == 2.0
    assert registry.get_sample_value("x_wait_seconds_sum", {"tier": "std"}) == pytest.approx(5.1)


def test_wrong_labels_and_negative_increments_are_refused() -> None:
    counter = LockFreeCounter("x_calls", "Calls.", ["provider"])
    with pytest.raises(ValueError):
        counter.labels("a", "b")
    with pytest.raises(ValueError):
        counter.labels(model="a")
    with pytest.raises(ValueError):
        counter.labels("a").inc(-1)
    with pytest.raises(ValueError):
        LockFreeCounter("x_plain", "Plain.").labels("a")


def test_a_name_taken_twice_in_one_registry_is_refused() -> None:
    registry = CollectorRegistry()
    LockFreeCounter("x_calls", "Calls.", registry=registry)
    with pytest.raises(ValueError):
        Counter("x_calls", "Calls.", registry=registry)


def test_the_brokers_families_render_with_every_preinitialised_series() -> None:
    metrics = Metrics()
    preinitialise(metrics, tiers=["standard"], providers=["sim"], models=["m"])
    metrics.request_series("chat", "standard", 200)[1].observe(0.002)
    text = metrics.render().decode()
    assert 'mergebroker_requests_total{endpoint="chat",status="200",tier="standard"} 0.0' in text
    assert 'mergebroker_request_latency_seconds_bucket{endpoint="chat",le="0.0025",tier="standard"} 1.0' in text
    assert 'mergebroker_upstream_calls_total{outcome="success",provider="sim"} 0.0' in text
    assert "# TYPE mergebroker_queue_wait_seconds histogram" in text
