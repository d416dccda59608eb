"""Compact a bulk file: the fewest upstream calls that answer every line, under the live merge rules.

Pure and synchronous. A bulk file is known in full before anything is sent, so every line can find its
partners at once: identical requests (same fingerprint) are sent once; the distinct ones are grouped by
compatibility key (`merge.shape`), then by similarity, `max_batch` and the model's context window with
the shared system prompt and header counted once (`merge.grouping`, `merge.budget.context_shares`), then
cut into the merges that pay and whose members' budgets fit the model's output limit (`Economics`: the
broker's `engine.merge_economy`, the live path's rule), and each group of two or more becomes one merged
call built as the live path builds it (`merge.merged_call`), whose `max_tokens` holds every member's own
budget plus its response tags. A line that may not merge (tools, multi-turn...) is a call of its own. The
runner sends the calls, settles merged replies with `merge.settle` (each member cut at its own budget,
`merge.member_budget`), and plans the members that failed a second time with `max_batch=1`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np

from mergebroker.merge.budget import context_shares
from mergebroker.merge.grouping import group_by_similarity, needs_embedding
from mergebroker.merge.member_budget import TokenCounter, estimate_tokens
from mergebroker.merge.merged_call import CallMember, CallRules, merged_call, own_budget
from mergebroker.merge.prompt import DEFAULT_HEADER
from mergebroker.merge.settle import SettleMember
from mergebroker.merge.shape import MergeShape


@dataclass(frozen=True)
class BulkItem:
    """One line of a bulk file, with what the planner needs to know about it (computed by the caller)."""

    custom_id: str
    body: Mapping[str, Any]
    fingerprint: str  # equal for identical requests (`merge.fingerprint.chat_fingerprint` within a scope)
    shape: MergeShape | None  # None: the line may not merge
    merge_key: str | None  # `merge.shape.compatibility_key`; None: the line may not merge
    prompt_tokens: int  # the whole request's estimated prompt tokens
    user_tokens: int  # the user text's own tokens (its share of a merged call's prompt)
    max_tokens: int  # its output budget, the broker's default where the line sets none (sizes merged calls)


@dataclass(frozen=True)
class PlannedMember:
    """One distinct request inside a planned call, and every line it answers (identical requests)."""

    custom_ids: tuple[str, ...]
    tag: str | None = None  # its block ID in a merged call; None in a call of one
    request_text: str = ""  # what leak checks protect: the user text (with its system prompt in tagged mode)
    user_tokens: int = 0  # its own text's share of the merged prompt
    prompt_tokens: int = 0  # its prompt had it been sent alone
    max_tokens: int | None = None  # its lines' own budget: its answer is cut there; None: they set none

    def settle_member(self, stop: str | list[str] | None) -> SettleMember:
        """What `merge.settle.settle` needs about this member (`stop`: its lines' stop sequences)."""
        return SettleMember(self.tag or "", self.request_text, self.user_tokens, self.prompt_tokens, stop,
                            self.max_tokens)


@dataclass(frozen=True)
class PlannedCall:
    """One upstream call of the compacted job: its body and the members it answers."""

    call_id: str
    model: str
    body: dict[str, Any]
    members: tuple[PlannedMember, ...]
    tokens: int  # estimated prompt plus output tokens, for the provider's TPM pacing

    @property
    def merged(self) -> bool:
        """True for a merged call (its reply must be split)."""
        return len(self.members) > 1

    @property
    def custom_ids(self) -> list[str]:
        """Every line this call answers."""
        return [c for m in self.members for c in m.custom_ids]

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready copy (the plan is stored while an upstream batch runs)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PlannedCall:
        """The inverse of `to_json`."""
        # `max_tokens` is absent from plans stored before members had budgets of their own.
        members = tuple(PlannedMember(tuple(m["custom_ids"]), m["tag"], m["request_text"], m["user_tokens"],
                                      m["prompt_tokens"], m.get("max_tokens")) for m in data["members"])
        return cls(data["call_id"], data["model"], dict(data["body"]), members, int(data["tokens"]))


class Economics(Protocol):
    """What merging costs and what a model allows, as the broker knows them (prices, limits, its policy)."""

    def split(self, model: str, system_prompt: str | None, members: Sequence[BulkItem], shared_tokens: int
              ) -> list[int]:
        """The sizes, in order, that a planned batch of `members` (each the head of its identical lines) is
        cut into, 1 being a member sent alone: merged only where the members' budgets fit the model's output
        limit and, by the merge policy, where it pays. `shared_tokens`: the shared system prompt's tokens."""
        ...

    def max_output_tokens(self, model: str) -> int | None:
        """The most output tokens one call to `model` may ask for; None where unknown."""
        ...


@dataclass(frozen=True)
class CompactionRules:
    """The merge rules a bulk job follows (those of the tier it runs in)."""

    threshold: float
    max_batch: int
    budget: Callable[[str], int]  # the model's context window in tokens
    header: str | None = None
    tagged_system: bool = False
    count_tokens: TokenCounter = estimate_tokens  # the broker's tokenizer: shared prefix, header, response tags
    economics: Economics | None = None  # None: every planned batch merges whole (as for an unpriced model)

    @property
    def call_rules(self) -> CallRules:
        """How its merged calls are built (the live path's `merge.merged_call` rules)."""
        return CallRules(self.count_tokens, self.header, self.tagged_system)


def plan_compaction(items: Sequence[BulkItem], rules: CompactionRules, *, vectors: Mapping[str, np.ndarray] | None = None,
                    rng: random.Random | None = None, prefix: str = "call") -> list[PlannedCall]:
    """The calls that answer every item exactly once, in order of first appearance.

    `vectors` (custom_id -> L2-normalised prompt vector) is consulted only when `rules.threshold > 0`; a
    group that needs vectors and lacks one is sent unmerged, never merged wrongly. `rng` draws the block
    IDs (`secrets` when None); `prefix` names the calls (`prefix-0`, `prefix-1`, ...).
    """
    distinct: dict[str, list[BulkItem]] = {}
    for item in items:
        distinct.setdefault(item.fingerprint, []).append(item)
    groups: dict[str | None, list[list[BulkItem]]] = {}
    alone: list[list[list[BulkItem]]] = []
    for copies in distinct.values():
        key = copies[0].merge_key if copies[0].shape is not None else None
        if key is None:
            alone.append([copies])
        else:
            groups.setdefault(key, []).append(copies)
    batches = [*alone]
    for group in groups.values():
        batches.extend(_batches(group, rules, vectors))
    position = {id(item): n for n, item in enumerate(items)}
    batches.sort(key=lambda batch: position[id(batch[0][0])])
    return [_call(f"{prefix}-{n}", batch, rules, rng) for n, batch in enumerate(batches)]


def _batches(group: list[list[BulkItem]], rules: CompactionRules,
             vectors: Mapping[str, np.ndarray] | None) -> list[list[list[BulkItem]]]:
    """Split one compatible group into batches by similarity, `max_batch` and the context budget."""
    heads = [copies[0] for copies in group]
    matrix = None
    if needs_embedding(len(heads), rules.threshold):
        if vectors is None or any(h.custom_id not in vectors for h in heads):
            return [[copies] for copies in group]
        matrix = np.stack([vectors[h.custom_id] for h in heads])
    model = str(heads[0].body.get("model"))
    system = None if rules.tagged_system else heads[0].shape.system_prompt  # type: ignore[union-attr]
    shared = rules.count_tokens(system) if system else 0
    costs, budget = context_shares([h.prompt_tokens + h.max_tokens for h in heads], window=rules.budget(model),
                                   shared=shared, header=rules.count_tokens(rules.header or DEFAULT_HEADER))
    plan = group_by_similarity(matrix, threshold=rules.threshold, max_batch=rules.max_batch, costs=costs,
                               budget=budget)
    batches = [[group[i] for i in batch] for batch in plan]
    if rules.economics is None:
        return batches
    return [part for batch in batches for part in _on_cost(batch, rules.economics, model, system, shared)]


def _on_cost(batch: list[list[BulkItem]], economics: Economics, model: str, system: str | None,
             shared: int) -> list[list[list[BulkItem]]]:
    """A planned batch cut into the merges worth making (`Economics.split`), in order."""
    if len(batch) < 2:
        return [batch]
    parts, start = [], 0
    for size in economics.split(model, system, [copies[0] for copies in batch], shared):
        parts.append(batch[start:start + size])
        start += size
    return parts


def _call(call_id: str, batch: list[list[BulkItem]], rules: CompactionRules, rng: random.Random | None) -> PlannedCall:
    head = batch[0][0]
    model = str(head.body.get("model"))
    tokens = sum(copies[0].prompt_tokens + copies[0].max_tokens for copies in batch)
    if len(batch) == 1:
        member = PlannedMember(tuple(i.custom_id for i in batch[0]), None, "", head.user_tokens, head.prompt_tokens,
                               own_budget(head.body))
        return PlannedCall(call_id, model, dict(head.body), (member,), tokens)
    limit = rules.economics.max_output_tokens(model) if rules.economics is not None else None
    call = merged_call([CallMember(copies[0].body, copies[0].shape, copies[0].max_tokens,  # type: ignore[arg-type]
                                   copies[0].prompt_tokens, copies[0].user_tokens) for copies in batch],
                       rules.call_rules, output_limit=limit, rng=rng)
    members = tuple(PlannedMember(tuple(i.custom_id for i in copies), m.id, m.request_text, m.own_prompt_tokens,
                                  m.alone_prompt_tokens, m.max_tokens) for m, copies in zip(call.members, batch))
    return PlannedCall(call_id, model, call.body, members, tokens)
