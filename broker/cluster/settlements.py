"""The provider's usage still to come for answers a worker released early, by correlation ID (front-end side).

A worker releases a merged call's member as soon as its block closes (`early_release`); the usage the
provider reports at the call's end follows as a `settled` message. The front-end's ledger waits for it on a
future from here. The merged call ends by the job's deadline; past it and `SETTLE_GRACE_S` the future is
cancelled and the ledger keeps the counted usage, so a worker that died mid-call leaves nothing waiting.
"""

from __future__ import annotations

import asyncio

from mergebroker.clock import Clock
from mergebroker.token_usage import TokenUsage

SETTLE_GRACE_S = 5.0  # how long past a job's deadline its early-released answer's usage may still arrive


class Settlements:
    """Futures of the usage to come, by correlation ID."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._by_cid: dict[str, asyncio.Future[TokenUsage]] = {}

    def expect(self, cid: str, deadline: float) -> asyncio.Future[TokenUsage]:
        """A future for the usage a `settled` message for `cid` will bring (cancelled past the grace)."""
        settling: asyncio.Future[TokenUsage] = asyncio.get_running_loop().create_future()
        self._by_cid[cid] = settling
        timer = self._clock.call_at(deadline + SETTLE_GRACE_S, settling.cancel)

        def settled(_f: asyncio.Future[TokenUsage]) -> None:
            timer.cancel()
            self._by_cid.pop(cid, None)

        settling.add_done_callback(settled)
        return settling

    def settle(self, cid: str, usage: TokenUsage) -> None:
        """The usage for `cid` arrived (dropped when nothing waits for it any more)."""
        settling = self._by_cid.pop(cid, None)
        if settling is not None and not settling.done():
            settling.set_result(usage)

    def cancel_all(self) -> None:
        """Stop waiting: the ledger keeps the counted usage."""
        for settling in list(self._by_cid.values()):
            settling.cancel()
