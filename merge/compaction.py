"""Compact a bulk file: the fewest upstream calls that answer every line, under the live merge rules.

Pure and synchronous. A bulk file is known in full before anything is sent, so every line can find its
partners at once: identical requests (same fingerprint) are sent once; the distinct ones are grouped by
compatibility key (`merge.shape`), then by similarity, `max_batch` and the context budget
(`merge.grouping`), and each group of two or more becomes one merged call (`merge.prompt`). A line that
may not merge (tools, multi-turn...) is a call of its own. The runner sends the calls, settles merged
replies with `merge.settle`, and plans the members that failed a second time with `max_batch=1`.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from mergebroker.merge.grouping import group_by_similarity, needs_embedding
from mergebroker.merge.prompt import MergeMember, merged_request_body, new_batch_ids
from mergebroker.merge.settle import SettleMember, member_request_text
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
    max_tokens: int


@dataclass(frozen=True)
class PlannedMember:
    """One distinct request inside a planned call, and every line it answers (identical requests)."""

    custom_ids: tuple[str, ...]
    tag: str | None = None  # its block ID in a merged call; None in a call of one
    request_text: str = ""  # what leak checks protect: the user text (with its system prompt in tagged mode)
    user_tokens: int = 0  # its own text's share of the merged prompt
    prompt_tokens: int = 0  # its prompt had it been sent alone

    def settle_member(self, stop: str | list[str] | None) -> SettleMember:
        """What `merge.settle.settle` needs about this member (`stop`: its lines' stop sequences)."""
        return SettleMember(self.tag or "", self.request_text, self.user_tokens, self.prompt_tokens, stop)


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
        members = tuple(PlannedMember(tuple(m["custom_ids"]), m["tag"], m["request_text"], m["user_tokens"],
                                      m["prompt_tokens"]) for m in data["members"])
        return cls(data["call_id"], data["model"], dict(data["body"]), members, int(data["tokens"]))


@dataclass(frozen=True)
class CompactionRules:
    """The merge rules a bulk job follows (those of the tier it runs in)."""

    threshold: float
    max_batch: int
    budget: Callable[[str], int]  # the model's context budget in tokens
    header: str | None = None
    tagged_system: bool = False


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
    costs = [h.prompt_tokens + h.max_tokens for h in heads]
    plan = group_by_similarity(matrix, threshold=rules.threshold, max_batch=rules.max_batch, costs=costs,
                               budget=rules.budget(str(heads[0].body.get("model"))))
    return [[group[i] for i in batch] for batch in plan]


def _call(call_id: str, batch: list[list[BulkItem]], rules: CompactionRules, rng: random.Random | None) -> PlannedCall:
    head = batch[0][0]
    model = str(head.body.get("model"))
    tokens = sum(copies[0].prompt_tokens + copies[0].max_tokens for copies in batch)
    if len(batch) == 1:
        member = PlannedMember(tuple(i.custom_id for i in batch[0]), None, "", head.user_tokens, head.prompt_tokens)
        return PlannedCall(call_id, model, dict(head.body), (member,), tokens)
    tags = new_batch_ids(len(batch), rng)
    shapes: list[MergeShape] = [copies[0].shape for copies in batch]  # type: ignore[misc]
    merge_members = [MergeMember(tag, s.user_text, copies[0].max_tokens, s.system_prompt)
                     for tag, s, copies in zip(tags, shapes, batch)]
    body = merged_request_body(head.body, merge_members, system_prompt=shapes[0].system_prompt,
                               header=rules.header, tagged_system=rules.tagged_system)
    members = tuple(PlannedMember(tuple(i.custom_id for i in copies), tag,
                                  member_request_text(s.system_prompt, s.user_text, rules.tagged_system),
                                  copies[0].user_tokens, copies[0].prompt_tokens)
                    for tag, s, copies in zip(tags, shapes, batch))
    return PlannedCall(call_id, model, body, members, tokens)

