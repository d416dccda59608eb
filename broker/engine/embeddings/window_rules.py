"""The embedding batcher's rules, apart from its state: when a window closes, how a batch's tokens are shared,
which upstream errors blame a text, and the timer and metrics hooks it is given (pure or nearly so)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from mergebroker.broker.engine.ground.metrics import Metrics
from mergebroker.errors import BrokerError, UpstreamHTTPError
from mergebroker.merge.cache import MetricsHook


class TimerHandle(Protocol):
    """What a scheduled callback returns: something that can be cancelled (`asyncio.TimerHandle`)."""

    def cancel(self) -> None: ...


CallLater = Callable[[float, Callable[[], None]], TimerHandle]
"""Schedules `callback` after `delay` seconds; the default is the running loop's `call_later`."""


def window_decision(items: int, tokens: int, new_tokens: int, *, max_batch_size: int,
                    max_batch_tokens: int) -> tuple[bool, bool]:
    """Where a new text of `new_tokens` goes: (close the open window before adding it, close it after).

    The open window holds `items` texts of `tokens` tokens. A text that would push a non-empty
    window past `max_batch_tokens` starts a new one; a window closes once either limit is reached.
    """
    close_before = items > 0 and tokens + new_tokens > max_batch_tokens
    if close_before:
        items, tokens = 0, 0
    close_after = items + 1 >= max_batch_size or tokens + new_tokens >= max_batch_tokens
    return close_before, close_after


def share_tokens(total: int, weights: Sequence[int]) -> list[float]:
    """`total` split in proportion to `weights` (all equal when every weight is 0)."""
    if not weights:
        return []
    weight_sum = sum(weights)
    if weight_sum <= 0:
        return [total / len(weights)] * len(weights)
    return [total * w / weight_sum for w in weights]


def caller_fault(exc: BrokerError) -> bool:
    """Whether the upstream blamed the request's input (a 4xx such as 400 or 413), not its own state.

    A 404 is left out: an unknown model fails every text alike, so retrying them one by one cannot help.
    """
    return isinstance(exc, UpstreamHTTPError) and exc.caller_fault and exc.upstream_status != 404


def cache_metrics_hook(metrics: Metrics) -> MetricsHook:
    """The `TwoLevelCache` hook that counts `embedding_cache_events{level,result}`."""
    return lambda level, result: metrics.embedding_cache_events.labels(level=level, result=result).inc()
