"""Counters and histograms counted in plain Python numbers and handed to Prometheus only when it scrapes.

prometheus_client takes a threading lock on every `inc()` and `observe()` (and checks the child on each),
which on the request path costs more than the count itself, several times per request. The families here
keep the same names, help, labels and samples (`_total`, `_bucket`, `_count`, `_sum`, `_created`), so
/metrics and the dashboards read the same; `collect()` builds the samples at scrape time.

They are counted without a lock, so only one thread may count into them: the event loop's. Everything on
the request path runs there, and so does the scrape (/metrics renders on the loop).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterator, Sequence

from prometheus_client import metrics as prometheus_metrics
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

INF = float("inf")


def _created_series() -> bool:
    # prometheus_client's own switch (PROMETHEUS_DISABLE_CREATED_SERIES, `disable_created_metrics()`), read
    # at each scrape as its families do, so ours and its export the same series.
    return bool(getattr(prometheus_metrics, "_use_created", True))


class CounterChild:
    """One labelled series of a `LockFreeCounter`."""

    __slots__ = ("value", "created")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1) -> None:
        """Add `amount` (not negative, as for any Prometheus counter)."""
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.value += amount


class HistogramChild:
    """One labelled series of a `LockFreeHistogram`: a count per bucket (not cumulative) and the sum."""

    __slots__ = ("_bounds", "counts", "sum", "created")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        """Count one observation in the first bucket whose upper bound is at least `amount`."""
        self.counts[bisect.bisect_left(self._bounds, amount)] += 1
        self.sum += amount


class LockFreeFamily(Collector):
    """A metric family: its children by label values, in the order they were first asked for."""

    _type = ""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (), *,
                 registry: CollectorRegistry | None = None) -> None:
        self._name = name
        self._documentation = documentation
        self._labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], object] = {}
        if not self._labelnames:
            self._children[()] = self._new_child()
        if registry is not None:
            registry.register(self)

    def _new_child(self) -> object:
        raise NotImplementedError

    def _child(self, *values: object, **by_name: object) -> object:
        if by_name:
            if values or set(by_name) != set(self._labelnames):
                raise ValueError(f"Incorrect label names for {self._name}: {sorted(by_name)}")
            values = tuple(by_name[name] for name in self._labelnames)
        key = tuple(str(v) for v in values)
        child = self._children.get(key)
        if child is None or not self._labelnames:
            if len(key) != len(self._labelnames) or not self._labelnames:
                raise ValueError(f"Incorrect label count for {self._name}: {len(key)} (of {self._labelnames})")
            child = self._children[key] = self._new_child()
        return child

    def _series(self) -> Iterator[tuple[dict[str, str], object]]:
        for key, child in list(self._children.items()):
            yield dict(zip(self._labelnames, key)), child

    def describe(self) -> list[Metric]:
        return [Metric(self._name, self._documentation, self._type)]


class LockFreeCounter(LockFreeFamily):
    """A Prometheus counter family (`mergebroker_x` exported as `mergebroker_x_total`)."""

    _type = "counter"

    def _new_child(self) -> CounterChild:
        return CounterChild()

    def labels(self, *values: object, **by_name: object) -> CounterChild:
        """The series for these label values (created at zero when first asked for)."""
        return self._child(*values, **by_name)  # type: ignore[return-value]

    def inc(self, amount: float = 1) -> None:
        """Add to the one series of an unlabelled counter."""
        self._children[()].inc(amount)  # type: ignore[attr-defined]

    def collect(self) -> list[Metric]:
        metric = Metric(self._name, self._documentation, self._type)
        created = _created_series()
        for labels, child in self._series():
            assert isinstance(child, CounterChild)
            metric.add_sample(self._name + "_total", labels, child.value)
            if created:
                metric.add_sample(self._name + "_created", labels, child.created)
        return [metric]


class LockFreeHistogram(LockFreeFamily):
    """A Prometheus histogram family with fixed buckets (a `+Inf` bucket is added)."""

    _type = "histogram"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (), *,
                 buckets: Sequence[float], registry: CollectorRegistry | None = None) -> None:
        bounds = tuple(float(b) for b in buckets)
        self._bounds = bounds if bounds and bounds[-1] == INF else (*bounds, INF)
        super().__init__(name, documentation, labelnames, registry=registry)

    def _new_child(self) -> HistogramChild:
        return HistogramChild(self._bounds)

    def labels(self, *values: object, **by_name: object) -> HistogramChild:
        """The series for these label values (created empty when first asked for)."""
        return self._child(*values, **by_name)  # type: ignore[return-value]

    def observe(self, amount: float) -> None:
        """Observe into the one series of an unlabelled histogram."""
        self._children[()].observe(amount)  # type: ignore[attr-defined]

    def collect(self) -> list[Metric]:
        metric = Metric(self._name, self._documentation, self._type)
        created = _created_series()
        bounds = [floatToGoString(b) for b in self._bounds]
        for labels, child in self._series():
            assert isinstance(child, HistogramChild)
            cumulative = 0.0
            for bound, count in zip(bounds, list(child.counts)):
                cumulative += count
                metric.add_sample(self._name + "_bucket", {**labels, "le": bound}, cumulative)
            metric.add_sample(self._name + "_count", labels, cumulative)
            metric.add_sample(self._name + "_sum", labels, child.sum)
            if created:
                metric.add_sample(self._name + "_created", labels, child.created)
        return [metric]
