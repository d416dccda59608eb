"""`mergebroker eval`: run a request set against one upstream alone and in merged batches, as production would.

Every request is sent once alone; then, for each batch size, the set is cut into batches (shuffled by the
seed: same seed, same batches; only requests allowed to share a call in production share one, by
`merge.shape.compatibility_key`) and each batch goes out as one merged call built by production's own builder
(`merge.merged_call`: the broker's tokenizer, the model's output limit, each member cut at its own budget),
settled as production settles it (`merge.settle`: split, leak checks, stop sequences). A member whose block
fails is answered by its alone call, as production re-sends it alone, and that call is counted. What the runs
observed (`Observation`s) is summarised and rendered by `broker.eval.report`.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from mergebroker.broker.engine.ground.tokens import count_text_tokens
from mergebroker.errors import BrokerError
from mergebroker.merge.member_budget import TokenCounter
from mergebroker.merge.merged_call import CallMember, CallRules, MergedCall, merged_call
from mergebroker.merge.settle import BAD_REPLY, MERGED_CALL_FAILED, SettleOptions, reply_text, settle
from mergebroker.merge.shape import MergeShape, compatibility_key, merge_shape
from mergebroker.output_budget import token_budget
from mergebroker.providers.simulator.quiz_set import builtin_set
from mergebroker.token_usage import TokenUsage

Chat = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
"""One upstream chat call: body -> the parsed completion (raises `BrokerError` on failure)."""
OutputLimit = Callable[[str], int | None]
"""A model's most output tokens per call, None where unknown (production reads its price table)."""

DEFAULT_MAX_TOKENS = 256
BUILTIN_MAX_TOKENS = 32
BUILTIN_SYSTEM = (
    "You are the answer engine of a quiz service. Each question has exactly one correct short answer: a "
    "number, a word, a city or a weekday. Reply with that answer only, with no explanation, no punctuation "
    "around it and no restating of the question. Numbers are written with digits, without thousands "
    "separators; units are those the question asks for. Words are written in lower case unless they are "
    "names. A question about letters counts every letter exactly as written. A question about days counts "
    "forward from the day it names, and the week starts on Monday. A reversed word keeps its letters' case. "
    "Never refuse: if a question seems ambiguous, give the most common reading's answer. Keep the answer on "
    "one line. The service compares your answer with the expected one after normalising case and spaces, so "
    "any extra word costs the point.")
"""The built-in set's shared system prompt: production traffic mostly carries one, and it is what a merge
shares (without it, merging short questions costs more tokens than it saves, and eval says so)."""


@dataclass(frozen=True)
class EvalRequest:
    """One request of the set: its chat body (without `expected`), its merge shape and its expected answer."""

    body: dict[str, Any]
    shape: MergeShape
    expected: str | None
    kind: str = "custom"

    @property
    def max_tokens(self) -> int:
        return token_budget(self.body, DEFAULT_MAX_TOKENS)


@dataclass(frozen=True)
class CallResult:
    """One upstream call: its text (None when it failed), usage, latency and the reply itself."""

    text: str | None
    prompt_tokens: int
    completion_tokens: int
    latency_s: float
    error: str | None = None
    reply: dict[str, Any] | None = None
    cached_tokens: int = 0  # of prompt_tokens: read from the provider's prompt cache, as it reported


@dataclass(frozen=True)
class MemberResult:
    """What one request got in a merged run: its block's answer, or the failure that sent it alone."""

    index: int
    block_answer: str | None
    failure: str | None
    latency_s: float


@dataclass(frozen=True)
class MergedRun:
    """One batch size's run: every member's result and every merged call made."""

    batch_size: int
    members: tuple[MemberResult, ...]
    calls: tuple[CallResult, ...]


@dataclass(frozen=True)
class Observation:
    """Everything the runs saw, for `broker.eval.report.summarise`."""

    requests: tuple[EvalRequest, ...]
    alone: tuple[CallResult, ...]
    merged: tuple[MergedRun, ...]


def builtin_requests(model: str, n: int = 200, *, seed: int = 0) -> list[EvalRequest]:
    """The built-in question set (`providers.simulator.quiz_set`) as requests at temperature 0, each with the
    shared system prompt `BUILTIN_SYSTEM`."""
    out = []
    for item in builtin_set(n, seed=seed):
        body = {"model": model, "messages": [{"role": "system", "content": BUILTIN_SYSTEM},
                                             {"role": "user", "content": item.question}],
                "temperature": 0, "max_tokens": BUILTIN_MAX_TOKENS}
        out.append(EvalRequest(body, MergeShape(BUILTIN_SYSTEM, item.question), item.expected, item.kind))
    return out


def load_requests(lines: Iterable[str], model: str) -> list[EvalRequest]:
    """Requests from JSONL chat bodies with an optional `expected`; raises ValueError naming a bad line."""
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            body = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"line {number}: not JSON ({exc})") from None
        if not isinstance(body, dict):
            raise ValueError(f"line {number}: not a JSON object")
        expected = body.pop("expected", None)
        for field in ("stream", "stream_options"):  # the evaluation reads whole answers; streams never merge
            body.pop(field, None)
        body["model"] = model
        shape = merge_shape(body)
        if shape is None:
            raise ValueError(f"line {number}: not a mergeable request (one optional system message and one "
                             "user message of text, no tools, n=1)")
        out.append(EvalRequest(body, shape, None if expected is None else str(expected)))
    if not out:
        raise ValueError("the request set is empty")
    return out


def plan_batches(requests: Sequence[EvalRequest], batch_size: int, *, seed: int) -> list[list[int]]:
    """Indices of `requests` cut into batches of at most `batch_size`, shuffled by `seed` (same seed, same
    batches); only requests that production would let share a call (same compatibility key) share one."""
    order = list(range(len(requests)))
    random.Random(f"{seed}:{batch_size}").shuffle(order)
    groups: dict[str, list[int]] = {}
    for i in order:
        groups.setdefault(compatibility_key(requests[i].body, requests[i].shape, scope_value="eval"), []).append(i)
    return [members[k:k + batch_size] for members in groups.values() for k in range(0, len(members), batch_size)]


async def call(chat: Chat, body: dict[str, Any], clock: Callable[[], float] = time.perf_counter) -> CallResult:
    """Make one call and record its text, usage and latency; a failure is recorded, never raised."""
    started = clock()
    try:
        reply = await chat(body)
    except BrokerError as exc:
        return CallResult(None, 0, 0, clock() - started, error=type(exc).__name__)
    read = reply_text(reply)
    usage = TokenUsage.from_body(reply) or TokenUsage(0, 0)
    if read is None:
        return CallResult(None, usage.prompt_tokens, usage.completion_tokens, clock() - started, error=BAD_REPLY,
                          cached_tokens=usage.cached_tokens)
    return CallResult(read[0], usage.prompt_tokens, usage.completion_tokens, clock() - started, reply=reply,
                      cached_tokens=usage.cached_tokens)


def eval_merged_call(requests: Sequence[EvalRequest], rules: CallRules, *, output_limit: int | None,
                     rng: random.Random | None) -> MergedCall:
    """The merged call of these requests, built by production's own builder (`merge.merged_call`)."""
    # Tokens saved are not measured here, so no member's alone prompt is counted.
    return merged_call([CallMember(r.body, r.shape, r.max_tokens) for r in requests], rules,
                       output_limit=output_limit, rng=rng)


def settle_batch(result: CallResult, call: MergedCall, *, leak_min_words: int,
                 count_tokens: TokenCounter = count_text_tokens) -> dict[str, tuple[str | None, str | None]]:
    """Each member's (answer, None), or (None, the reason production would re-send it alone), by the
    dispatcher's own rule (`merge.settle`, with the broker's tokenizer for the members' own budgets)."""
    if result.reply is None:
        return {i: (None, BAD_REPLY if result.error == BAD_REPLY else MERGED_CALL_FAILED) for i in call.ids}
    settlement = settle(result.reply, call.members, SettleOptions(leak_min_words, count_tokens))
    return {i: (settlement.answers[i].text, None) if i in settlement.answers else (None, settlement.fallbacks[i])
            for i in call.ids}


class Evaluator:
    """Runs a request set alone and merged against one upstream (`chat`), `concurrency` calls at a time."""

    def __init__(self, chat: Chat, requests: Sequence[EvalRequest], *, seed: int = 0, concurrency: int = 8,
                 header: str | None = None, leak_min_words: int = 8, output_limit: OutputLimit = lambda model: None,
                 progress: Callable[[int], None] = lambda n: None) -> None:
        self._chat = chat
        self._requests = list(requests)
        self._seed = seed
        self._limit = asyncio.Semaphore(concurrency)
        self._rules = CallRules(count_text_tokens, header)
        self._output_limit = output_limit
        self._leak_min_words = leak_min_words
        self._progress = progress

    def total_calls(self, batch_sizes: Sequence[int]) -> int:
        """How many calls `run` makes at least (fallbacks reuse the alone answers and make none here)."""
        return len(self._requests) + sum(len(plan_batches(self._requests, n, seed=self._seed)) for n in batch_sizes)

    async def run(self, batch_sizes: Sequence[int]) -> Observation:
        """Every request alone, then merged at every batch size."""
        alone = await asyncio.gather(*(self._call(r.body) for r in self._requests))
        merged = [await self._merged(n) for n in batch_sizes]
        return Observation(tuple(self._requests), tuple(alone), tuple(merged))

    async def _call(self, body: dict[str, Any]) -> CallResult:
        async with self._limit:
            result = await call(self._chat, body)
        self._progress(1)
        return result

    async def _merged(self, batch_size: int) -> MergedRun:
        rng = random.Random(f"ids:{self._seed}:{batch_size}")
        batches = plan_batches(self._requests, batch_size, seed=self._seed)
        built = [eval_merged_call([self._requests[i] for i in b], self._rules, rng=rng,
                                  output_limit=self._output_limit(self._requests[b[0]].body["model"]))
                 for b in batches]
        calls = await asyncio.gather(*(self._call(merged.body) for merged in built))
        members = []
        for batch, merged, result in zip(batches, built, calls):
            settled = settle_batch(result, merged, leak_min_words=self._leak_min_words)
            for index, member_id in zip(batch, merged.ids):
                members.append(MemberResult(index, *settled[member_id], result.latency_s))
        return MergedRun(batch_size, tuple(sorted(members, key=lambda m: m.index)), tuple(calls))

