"""A job's calls sent through a provider's own Batch API: upload, create, poll, map back, cancel.

A round is recorded in the batch store (its upstream batch ID and its plan) before it is polled, so a
restarted broker polls the upstream batch it already submitted instead of submitting a second one. An
upstream batch is cancelled when the job is cancelled or its window ends; calls it never ran leave their
lines unanswered. A round that cannot be submitted goes through the pools instead.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog

from mergebroker.broker.bulk.lines import jsonl
from mergebroker.broker.bulk.settling import Outcome
from mergebroker.broker.bulk.store import BatchStore, UpstreamRound
from mergebroker.clock import Sleep, sleep_or_event
from mergebroker.errors import UpstreamError, UpstreamHTTPError
from mergebroker.merge.compaction import PlannedCall
from mergebroker.providers.openai.batches import BatchApi

log = structlog.get_logger(__name__)

CHAT_URL = "/v1/chat/completions"
FINAL_UPSTREAM = ("completed", "failed", "expired", "cancelled")


@dataclass(frozen=True)
class RoundHooks:
    """What a round hands back to its job: sending through the pools instead, settling, counting."""

    direct: Callable[[list[PlannedCall]], Awaitable[list[str]]]
    settle: Callable[[PlannedCall, Outcome], Awaitable[list[str]]]
    count: Callable[[str, PlannedCall], None]
    stopped: Callable[[], bool]


class UpstreamRounds:
    """One job's rounds through providers' Batch APIs."""

    def __init__(self, *, batch_id: str, completion_window: str, cancel: asyncio.Event, store: BatchStore,
                 apis: dict[str, BatchApi], poll_interval_s: float, sleep: Sleep, hooks: RoundHooks) -> None:
        self._batch_id = batch_id
        self._window = completion_window
        self._cancel = cancel
        self._store = store
        self._apis = apis
        self._interval = poll_interval_s
        self._sleep = sleep
        self._hooks = hooks

    async def send(self, api: BatchApi, calls: list[PlannedCall], number: int) -> list[str]:
        """Send calls as one upstream batch (through the pools if it cannot be submitted); the lines to re-run."""
        if self._hooks.stopped():
            return []
        data = jsonl({"custom_id": c.call_id, "method": "POST", "url": CHAT_URL, "body": c.body} for c in calls)
        try:
            file_id = await api.upload(data, filename=f"{self._batch_id}-{number}.jsonl")
            upstream = await api.create_batch(file_id, endpoint=CHAT_URL, completion_window=self._window)
        except UpstreamError as exc:
            log.warning("upstream_batch_refused", batch_id=self._batch_id, provider=api.name,
                        error=type(exc).__name__)
            return await self._hooks.direct(calls)
        found = UpstreamRound(number, api.name, upstream["id"], [c.to_json() for c in calls])
        await self._store.put_round(self._batch_id, found)
        return await self._collect(api, found)

    async def resume(self) -> list[str]:
        """Map back the upstream batches a previous run submitted; the custom_ids to re-run alone."""
        retry: list[str] = []
        for found in await self._store.open_rounds(self._batch_id):
            api = self._apis.get(found.provider)
            if api is None:  # the provider is no longer configured for batches: its lines are planned again
                await self._store.finish_round(self._batch_id, found)
                continue
            retry += await self._collect(api, found)
        return retry

    async def _collect(self, api: BatchApi, found: UpstreamRound) -> list[str]:
        """Poll an upstream batch to its end, then settle every call it answered."""
        upstream = await self._poll(api, found.upstream_id)
        replies: dict[str, tuple[int, dict[str, Any]]] = {}
        for key in ("output_file_id", "error_file_id"):
            if upstream.get(key):
                replies.update(read_output(await api.content(upstream[key])))
        retry: list[str] = []
        for data in found.calls:
            call = PlannedCall.from_json(data)
            if call.call_id not in replies:
                continue  # cancelled or expired upstream before it ran: the line stays unanswered
            status, body = replies[call.call_id]
            self._hooks.count("batch_api", call)
            outcome = body if status == 200 else UpstreamHTTPError(status, _message(body), body=body)
            retry += await self._hooks.settle(call, outcome)
        await self._store.finish_round(self._batch_id, found)
        return retry

    async def _poll(self, api: BatchApi, upstream_id: str) -> dict[str, Any]:
        """Retrieve the upstream batch until it ends; cancel it when the job is cancelled or its window ends."""
        asked_cancel = False
        while True:
            try:
                upstream = await api.retrieve_batch(upstream_id)
                if upstream.get("status") in FINAL_UPSTREAM:
                    return upstream
                if self._hooks.stopped() and not asked_cancel:
                    await api.cancel_batch(upstream_id)
                    asked_cancel = True
            except UpstreamError as exc:
                log.warning("upstream_batch_poll_failed", batch_id=self._batch_id, error=type(exc).__name__)
            waker = asyncio.Event() if asked_cancel else self._cancel
            await sleep_or_event(self._sleep, self._interval, waker)


def read_output(raw: bytes) -> dict[str, tuple[int, dict[str, Any]]]:
    """custom_id -> (status, body) from an upstream batch's output or error file; unreadable lines are skipped."""
    found: dict[str, tuple[int, dict[str, Any]]] = {}
    for line in raw.decode("utf-8", "replace").split("\n"):
        try:
            data = json.loads(line)
            response = data.get("response") or {}
            given = response.get("body")
            body: dict[str, Any] = given if isinstance(given, dict) else {"error": data.get("error")}
            found[str(data["custom_id"])] = (int(response.get("status_code") or 500), body)
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return found


def _message(body: dict[str, Any]) -> str:
    error = body.get("error")
    return str(error.get("message")) if isinstance(error, dict) and error.get("message") else "upstream batch line failed"
