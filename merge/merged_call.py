"""Members -> merged call: the one builder live dispatch, bulk compaction and `mergebroker eval` share (pure).

Given the requests that are to share one upstream call, in order, it draws their block IDs (none that any
member's own text names: answers echo their prompts), builds the body (`merge.prompt.merged_request_body`:
the first member's parameters, the combined messages, and a budget that holds every member's own plus its
block's tags, counted with the broker's tokenizer and capped at the model's output limit), and says what
settling needs of each member (`merge.settle.SettleMember`: the text its leak check protects, its share of
the prompt, its stop sequences and its own budget, where its answer is cut). Because all three paths build
here, what `mergebroker eval` measures is byte for byte the merged call production sends.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mergebroker.merge.member_budget import TokenCounter
from mergebroker.merge.prompt import MergeMember, merged_request_body, new_batch_ids
from mergebroker.merge.settle import SettleMember, member_request_text
from mergebroker.merge.shape import MergeShape
from mergebroker.output_budget import token_budget


@dataclass(frozen=True)
class CallMember:
    """One request going into a merged call."""

    body: Mapping[str, Any]  # its own request: its sampling fields, `stop` and its own budget
    shape: MergeShape
    max_tokens: int  # the budget that sizes the call: its own, or the broker's default where it set none
    alone_prompt_tokens: int = 0  # its prompt's tokens had it been sent alone (tokens saved)
    user_tokens: int | None = None  # its text's tokens where counted already; None: counted here


@dataclass(frozen=True)
class CallRules:
    """How a tier builds merged calls: its header, its system-prompt mode and the broker's tokenizer."""

    count_tokens: TokenCounter
    header: str | None = None
    tagged_system: bool = False


@dataclass(frozen=True)
class MergedCall:
    """A merged call's body and, in the order the members were given, what settling needs of each."""

    body: dict[str, Any]
    members: tuple[SettleMember, ...]

    @property
    def ids(self) -> list[str]:
        """The members' block IDs, in order."""
        return [m.id for m in self.members]


def merged_call(members: Sequence[CallMember], rules: CallRules, *, output_limit: int | None = None,
                rng: random.Random | None = None) -> MergedCall:
    """The merged call of `members` (two or more, the first's body its template).

    `output_limit`: the model's most output tokens, where known. `rng` draws the block IDs (`secrets` when
    None: no member can guess them)."""
    ids = new_batch_ids(len(members), rng, avoid=[t for m in members
                                                  for t in (m.shape.user_text, m.shape.system_prompt) if t])
    first = members[0]
    body = merged_request_body(first.body, [MergeMember(i, m.shape.user_text, m.max_tokens, m.shape.system_prompt)
                                            for i, m in zip(ids, members)],
                               system_prompt=first.shape.system_prompt, header=rules.header,
                               tagged_system=rules.tagged_system, count_tokens=rules.count_tokens,
                               output_limit=output_limit)
    return MergedCall(body, tuple(_settle_member(i, m, rules) for i, m in zip(ids, members)))


def own_budget(body: Mapping[str, Any]) -> int | None:
    """The output budget a request set itself, where its merged answer is cut; None where it set none.

    The broker's default only sizes a merged call: alone, a request without a budget would not have been
    cut at it either."""
    return token_budget(body, 0) or None


def _settle_member(member_id: str, member: CallMember, rules: CallRules) -> SettleMember:
    shape = member.shape
    user_tokens = member.user_tokens if member.user_tokens is not None else rules.count_tokens(shape.user_text)
    return SettleMember(member_id, member_request_text(shape.system_prompt, shape.user_text, rules.tagged_system),
                        user_tokens, member.alone_prompt_tokens, member.body.get("stop"), own_budget(member.body))
