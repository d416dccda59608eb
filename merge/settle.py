"""Settling a merged call: one pure decision per member, which `broker.engine.chat.dispatch` then carries out.

Every member ends in exactly one of three places of a `Settlement`:
    answers    its own answer, cut out of the merged reply (stop sequences applied, cut at its own
               `max_tokens` with finish_reason "length", usage apportioned)
    fallbacks  re-send it alone, with the reason (a metric label)
    errors     fail it at once (alone it would meet the same refusal)

Fallback reasons:
    bad_reply           the reply has no readable text (every member)
    merged_call_failed  the merged call itself failed in a way sending alone may avoid (every member)
    leak                the member's answer quotes another member's request or names its ID
    missing, empty, duplicated, malformed, truncated, foreign_id: its block (see `merge.split`)

A block the merged call's token limit cut short (truncated) is still an answer when its text so far
reached the member's own budget, or holds one of its stop sequences: alone, it would have ended there too.

`settle_block` judges one member's block on its own, so answers can be settled as blocks arrive; only
the usage split waits for the whole reply.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mergebroker.errors import BrokerError, NotFound, UpstreamUnavailable
from mergebroker.merge.leak import find_leaks
from mergebroker.merge.member_budget import LENGTH, STOP, TokenCounter, cut_to_budget, estimate_tokens, reached_budget
from mergebroker.merge.split import BlockFailure, split_reply, truncated_block
from mergebroker.merge.usage import apportion_usage
from mergebroker.token_usage import NO_USAGE, TokenUsage

BAD_REPLY = "bad_reply"
MERGED_CALL_FAILED = "merged_call_failed"
LEAK = "leak"


@dataclass(frozen=True)
class SettleMember:
    """What settling needs to know of one member of a merged call."""

    id: str  # its correlation ID in the combined prompt
    request_text: str  # its own request as the call carried it (leak checks): user text, plus system if tagged
    own_prompt_tokens: int  # tokens of its own text in the combined prompt (its share of the prompt)
    alone_prompt_tokens: int  # its prompt's tokens had it been sent alone (tokens saved)
    stop: str | list[str] | None = None  # cut here, as the upstream would have for it alone
    max_tokens: int | None = None  # its own output budget: its answer ends there ("length"); None: none


@dataclass(frozen=True)
class SettleOptions:
    """Engine-wide settling options; `count_tokens` is the broker's tokenizer (members' budgets)."""

    leak_min_words: int = 8
    count_tokens: TokenCounter = estimate_tokens


@dataclass(frozen=True)
class MemberAnswer:
    """A member's own answer out of a merged reply."""

    text: str
    usage: TokenUsage
    finish_reason: str = STOP


@dataclass(frozen=True)
class BlockVerdict:
    """One block judged: the member's answer as it receives it (stop sequences applied, cut at its budget)
    and how it ends, or (answer None) the reason to re-send it alone."""

    answer: str | None
    reason: str | None = None
    finish_reason: str = STOP


@dataclass(frozen=True)
class Settlement:
    """The decision for every member of a merged call (see the module docstring)."""

    answers: dict[str, MemberAnswer] = field(default_factory=dict)
    fallbacks: dict[str, str] = field(default_factory=dict)
    errors: dict[str, BrokerError] = field(default_factory=dict)
    tokens_saved: int = 0  # prompt tokens the members would have cost alone, less what the call cost
    needed_fallback: bool | None = None  # what the quality guard learns; None: nothing about merging


def member_request_text(system_prompt: str | None, user_text: str, tagged_system: bool) -> str:
    """A member's request as a merged call carries it, which its leak check protects: the user text and, with
    tagged system prompts (each member's own system prompt travels in the call too), the system prompt."""
    return system_prompt + "\n" + user_text if tagged_system and system_prompt else user_text


def settle(reply: Any, members: Sequence[SettleMember], options: SettleOptions) -> Settlement:
    """Settle a merged reply: split it by ID, judge each block, apportion usage over the answers."""
    read = reply_text(reply)
    if read is None:
        return every_member(members, BAD_REPLY)
    content, finish_reason = read
    ids = [m.id for m in members]
    blocks = split_reply(content, ids, finish_reason=finish_reason)
    cut = truncated_block(content, ids, finish_reason=finish_reason)
    requests = {m.id: m.request_text for m in members}
    verdicts = {m.id: settle_block(m, blocks[m.id], requests, options,
                                   partial=cut[1] if cut is not None and cut[0] == m.id else "") for m in members}
    good = {i: v.answer for i, v in verdicts.items() if v.answer is not None}
    # Weighed by what the upstream generated for each answer: its block before stop sequences and budget.
    generated = {i: b if isinstance(b, str) else (cut[1] if cut is not None else "")
                 for i, b in blocks.items() if i in good}
    reported = TokenUsage.from_body(reply) or NO_USAGE
    usage = apportion_reported(reported, members, generated)
    answers = {m.id: MemberAnswer(good[m.id], usage[m.id], verdicts[m.id].finish_reason)
               for m in members if m.id in good}
    fallbacks = {i: v.reason for i, v in verdicts.items() if v.reason is not None}
    saved = 0
    if answers:
        saved = max(0, sum(m.alone_prompt_tokens for m in members) - reported.prompt_tokens)
    return Settlement(answers, fallbacks, tokens_saved=saved, needed_fallback=bool(fallbacks))


def settle_block(member: SettleMember, block: str | BlockFailure, requests: Mapping[str, str],
                 options: SettleOptions, *, partial: str = "") -> BlockVerdict:
    """Judge one member's block: a broken block or an answer that leaks another member's request falls back;
    an answer ends at its first stop sequence, then at its budget ("length").

    `partial` is a TRUNCATED block's text so far (cut short by the merged call's limit, or still streaming):
    an answer when it holds a stop sequence or reached the member's budget (alone, the member would have
    ended there too), else the block falls back as truncated.
    """
    at_budget = False
    if block is BlockFailure.TRUNCATED and partial:
        if len(apply_stop(partial, member.stop)) < len(partial):
            block = partial
        elif reached_budget(partial, member.max_tokens, options.count_tokens):
            block, at_budget = partial, True
    if isinstance(block, BlockFailure):
        return BlockVerdict(None, block.value)
    if find_leaks({member.id: block}, requests, min_words=options.leak_min_words):
        return BlockVerdict(None, LEAK)
    ending = cut_to_budget(apply_stop(block, member.stop), member.max_tokens, options.count_tokens)
    return BlockVerdict(ending.text, finish_reason=LENGTH if at_budget else ending.finish_reason)


def settle_call_error(exc: BrokerError, members: Sequence[SettleMember]) -> Settlement:
    """Settle a merged call that failed: a refusal each member would meet alone fails them all at once;
    anything else may be the merged call's own problem (its size, its deadline, its upstream), so each
    member is re-sent alone."""
    if isinstance(exc, (UpstreamUnavailable, NotFound)):
        return Settlement(errors={m.id: exc for m in members})
    return every_member(members, MERGED_CALL_FAILED)


def every_member(members: Sequence[SettleMember], reason: str) -> Settlement:
    """Every member re-sent alone for `reason`; the merge counts as needing a fallback."""
    return Settlement(fallbacks={m.id: reason for m in members}, needed_fallback=True)


def reply_text(reply: Any) -> tuple[str, str | None] | None:
    """The first choice's text and finish reason of a merged reply, or None when the reply is unusable."""
    choices = reply.get("choices") if isinstance(reply, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices else None
    message = choice.get("message") if isinstance(choice, dict) else None
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, str):
        return None
    finish_reason = choice.get("finish_reason")  # type: ignore[union-attr]
    return content, finish_reason if isinstance(finish_reason, str) else None


def apply_stop(text: str, stop: str | list[str] | None) -> str:
    """Cut a member's answer at its first stop sequence, as the upstream would have."""
    sequences = [stop] if isinstance(stop, str) else list(stop or [])
    cut = min((i for i in (text.find(s) for s in sequences if s) if i >= 0), default=len(text))
    return text[:cut]


def apportion_reported(usage: TokenUsage, members: Sequence[SettleMember],
                       answers: Mapping[str, str]) -> dict[str, TokenUsage]:
    """Each member's share of a merged call's reported `usage`, weighed by its answer's length, never above
    its own budget: alone, it could not have cost more."""
    return apportion_usage(
        usage,
        member_prompt_tokens={m.id: m.own_prompt_tokens for m in members},
        member_completion_weights={m.id: max(1, len(answers.get(m.id, ""))) for m in members},
        member_completion_caps={m.id: m.max_tokens for m in members if m.max_tokens},
    )
