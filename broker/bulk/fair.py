"""Bulk call slots shared round-robin across tenants: one tenant's large job never queues another's small one.

`batches.concurrency` slots are shared by every job. A plain semaphore hands them out in arrival order, so a
job that queued 800 calls first makes a later job of another tenant wait for all of them. Here waiters queue
per tenant and a freed slot goes to the tenant whose turn it is (tenants in the order they began waiting; a
tenant served goes to the back while it still waits), so another tenant's call waits at most for the next
slot to free: one call's time. Within a tenant, calls keep their order.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict, deque
from collections.abc import AsyncIterator


class FairSlots:
    """`capacity` slots, handed to waiting tenants in turn (round-robin)."""

    def __init__(self, capacity: int) -> None:
        self._free = capacity
        self._waiting: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()

    @property
    def free(self) -> int:
        """Slots nobody holds right now."""
        return self._free

    def waiting(self, tenant: str | None = None) -> int:
        """Callers waiting for a slot (of `tenant`, or of everyone)."""
        queues = self._waiting.values() if tenant is None else [self._waiting.get(tenant, deque())]
        return sum(1 for q in queues for f in q if not f.done())

    @contextlib.asynccontextmanager
    async def slot(self, tenant: str) -> AsyncIterator[None]:
        """Hold one slot for the block, taken in `tenant`'s turn."""
        await self.acquire(tenant)
        try:
            yield
        finally:
            self.release()

    async def acquire(self, tenant: str) -> None:
        """Wait for a slot in `tenant`'s turn."""
        if self._free > 0 and not self._waiting:
            self._free -= 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(tenant, deque()).append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # the slot came with the cancellation: hand it on
            else:
                self._forget(tenant, waiter)
            raise

    def release(self) -> None:
        """Give a slot back: to the next tenant in turn, or to the free pool when nobody waits."""
        while self._waiting:
            tenant, queue = next(iter(self._waiting.items()))
            waiter = queue.popleft()
            if queue:
                self._waiting.move_to_end(tenant)  # served: its next call waits for the others' turns
            else:
                del self._waiting[tenant]
            if not waiter.done():
                waiter.set_result(None)
                return
        self._free += 1

    def _forget(self, tenant: str, waiter: asyncio.Future[None]) -> None:
        queue = self._waiting.get(tenant)
        if queue is None:
            return
        with contextlib.suppress(ValueError):
            queue.remove(waiter)
        if not queue:
            del self._waiting[tenant]
