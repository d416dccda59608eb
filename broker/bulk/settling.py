"""Turn one planned call's outcome into its lines' results (pure): who got an answer, who failed, who goes again.

A call of one member answers each of its identical lines with the reply (usage split evenly among them); a
merged call is settled with `merge.settle`: each member's answer ends at its own `max_tokens` (counted with
the broker's tokenizer, `finish_reason: "length"`, usage to match), a block the merged call's limit cut
short is an answer once it reached its member's budget, and the members whose block failed (missing,
truncated, leaked, unreadable) are named with the reason, to be re-run alone. An error outcome is every line's error, except in a merged
call, whose members all go again alone (`settle_call_error` decides which errors allow that). `call_share`
names the call for the usage ledger, so its lines count as one upstream call however many it answered.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from mergebroker.broker.engine.ground.tokens import count_text_tokens
from mergebroker.errors import BrokerError
from mergebroker.merge.compaction import PlannedCall, PlannedMember
from mergebroker.merge.completion import member_completion
from mergebroker.merge.settle import BAD_REPLY, SettleOptions, every_member, settle, settle_call_error
from mergebroker.merge.usage import largest_remainder
from mergebroker.token_usage import TokenUsage

log = structlog.get_logger(__name__)

Result = tuple[str, int, dict[str, Any]]
"""One line's result: custom_id, HTTP status, body."""
Outcome = dict[str, Any] | BrokerError
"""What one upstream call gave: the reply body, or the error."""


@dataclass(frozen=True)
class CallShare:
    """One upstream call as the usage ledger counts it: its lines share one call and split its usage."""

    batch_id: str  # unique per upstream call: every line it answered carries it
    lines: int  # the lines it answered (1: a line sent alone); the ledger's `batch_size`
    alone_prompt_tokens: Mapping[str, int]  # custom_id -> its prompt had it been sent alone (the broker's count)


def call_share(call: PlannedCall, batch_id: str) -> CallShare:
    """`call` as the ledger counts it, under `batch_id`: each of its lines, identical copies included, would
    have sent its member's whole prompt alone."""
    alone = {c: m.prompt_tokens for m in call.members for c in m.custom_ids}
    return CallShare(batch_id, len(alone), alone)


def judge(call: PlannedCall, outcome: Outcome, *, stop: Any, leak_min_words: int) -> tuple[list[Result], dict[str, str]]:
    """Results per line, and the members (by tag) to re-run alone with the reason (`stop`: the lines' stop)."""
    if not call.merged:
        if isinstance(outcome, BrokerError):
            return failed(call.custom_ids, outcome), {}
        return shared(call.members[0], outcome), {}
    members = [m.settle_member(stop) for m in call.members]
    if isinstance(outcome, BrokerError):
        settlement = settle_call_error(outcome, members)
    else:
        try:
            settlement = settle(outcome, members, SettleOptions(leak_min_words, count_text_tokens))
        except Exception:  # noqa: BLE001 - a reply we cannot read must not cost the members their answers
            log.exception("merged_reply_unreadable", call_id=call.call_id)
            settlement = every_member(members, BAD_REPLY)
    results: list[Result] = []
    for m in call.members:
        answer = settlement.answers.get(m.tag)  # type: ignore[arg-type]
        error = settlement.errors.get(m.tag)  # type: ignore[arg-type]
        if answer is not None:
            completion = member_completion(outcome, answer.text, answer.usage,  # type: ignore[arg-type]
                                           finish_reason=answer.finish_reason)
            results += shared(m, completion)
        elif error is not None:
            results += failed(m.custom_ids, error)
    return results, settlement.fallbacks


def failed(custom_ids: list[str] | tuple[str, ...], error: BrokerError) -> list[Result]:
    """The same error for each line."""
    body = error.body()
    return [(c, error.status, body) for c in custom_ids]


def shared(member: PlannedMember, body: dict[str, Any]) -> list[Result]:
    """One member's completion for each of its identical lines, the call's usage split evenly among them."""
    ids = member.custom_ids
    usage = TokenUsage.from_body(body)
    if len(ids) == 1 or usage is None:
        return [(c, 200, body) for c in ids]
    ones = [1] * len(ids)
    prompts = largest_remainder(usage.prompt_tokens, ones)
    completions = largest_remainder(usage.completion_tokens, ones)
    return [(c, 200, {**body, "usage": TokenUsage(p, o).as_body()}) for c, p, o in zip(ids, prompts, completions)]
