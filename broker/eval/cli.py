"""The `mergebroker eval` command: options, the upstream, the progress bar, the report files.

The runs are `broker.eval.run`, the figures `broker.eval.report`. Prose answers are compared by the cosine
of their embeddings from the broker's own similarity model, loaded only when a prose pair comes up.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from tqdm import tqdm

from mergebroker.broker.eval.report import (
    EvalSummary,
    Scorer,
    default_scorer,
    render_chart,
    render_json,
    render_markdown,
    summarise,
)
from mergebroker.broker.eval.run import Evaluator, Observation, builtin_requests, load_requests
from mergebroker.merge.fidelity import compare, needs_cosine
from mergebroker.merge.pricing import ModelPrice, PriceTable
from mergebroker.providers.openai.compat import HttpProviderSettings, OpenAICompatProvider

DEFAULT_KEY_ENV = "MERGEBROKER_UPSTREAM_API_KEY"


def _sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of batch sizes: {text!r} (use e.g. 2,4,8)") from None
    if not sizes or sizes[0] < 2:
        raise argparse.ArgumentTypeError("batch sizes must be integers of at least 2")
    return sizes


def _price(text: str) -> ModelPrice:
    try:
        fresh, cached, output = (float(part) for part in text.split(","))
        return ModelPrice(fresh, cached, output)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected three non-negative numbers INPUT,CACHED,OUTPUT: {exc}") from None


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `mergebroker eval` options to `parser`."""
    parser.add_argument("--upstream", required=True, metavar="URL",
                        help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8001/v1")
    parser.add_argument("--model", required=True, help="the model to evaluate")
    parser.add_argument("--api-key-env", default=DEFAULT_KEY_ENV, metavar="NAME",
                        help="environment variable holding the upstream's API key (default: %(default)s)")
    parser.add_argument("--requests", metavar="FILE.jsonl",
                        help="chat bodies, one per line, each with an optional 'expected' answer "
                             "(default: the built-in set of short questions with computed answers)")
    parser.add_argument("--builtin", type=int, default=200, metavar="N", help="size of the built-in set (default: 200)")
    parser.add_argument("--batch-sizes", type=_sizes, default=[2, 4, 8], metavar="2,4,8",
                        help="merged batch sizes to try (default: 2,4,8)")
    parser.add_argument("--seed", type=int, default=0, help="same seed, same set and same batches (default: 0)")
    parser.add_argument("--tolerance", type=float, default=2.0, metavar="POINTS",
                        help="accuracy/agreement points below alone still accepted (default: 2)")
    parser.add_argument("--price", type=_price, metavar="INPUT,CACHED,OUTPUT",
                        help="USD per million tokens (fresh input, cached input, output) to price each size's "
                             "calls; default: the shipped price table's, where it has the model")
    parser.add_argument("--concurrency", type=int, default=8, help="calls in flight at once (default: 8)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per call (default: 120)")
    parser.add_argument("--out", default="eval-report", metavar="DIR",
                        help="where eval.md, eval.json and eval.png go (default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_eval(ns: argparse.Namespace, *, environ: Mapping[str, str] = os.environ) -> int:
    """Run `mergebroker eval` with parsed arguments; returns the exit code."""
    return asyncio.run(eval_command(ns, environ=environ))


async def eval_command(ns: argparse.Namespace, *, environ: Mapping[str, str] = os.environ) -> int:
    """`run_eval` inside a running loop: load the set, run it, write eval.md, eval.json and eval.png."""
    try:
        requests = (load_requests(Path(ns.requests).read_text(encoding="utf-8").splitlines(), ns.model)
                    if ns.requests else builtin_requests(ns.model, ns.builtin, seed=ns.seed))
    except (OSError, ValueError) as exc:
        print(f"mergebroker eval: {ns.requests}: {exc}", file=sys.stderr)
        return 2
    summary = await evaluate(ns, requests, api_key=environ.get(ns.api_key_env))
    if summary.alone_failed == summary.requests:
        print(f"mergebroker eval: every call to {ns.upstream} failed; check --upstream, --model and "
              f"${ns.api_key_env}", file=sys.stderr)
        return 1
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    chart = render_chart(summary, str(out / "eval.png"))
    (out / "eval.json").write_text(render_json(summary) + "\n", encoding="utf-8")
    (out / "eval.md").write_text(render_markdown(summary, chart="eval.png" if chart else None), encoding="utf-8")
    print(f"{out / 'eval.md'}: recommended max_batch {summary.recommended_max_batch} for {summary.model} "
          f"({summary.reason})"
          + ("" if chart else "; no chart (matplotlib is in the 'bench' extra)"), file=sys.stderr)
    return 0


async def evaluate(ns: argparse.Namespace, requests: list[Any], *, api_key: str | None) -> EvalSummary:
    """Run the set against the upstream and summarise it."""
    provider = OpenAICompatProvider(HttpProviderSettings(name="eval", base_url=ns.upstream, api_key=api_key,
                                                         max_connections=max(1, ns.concurrency)))

    async def chat(body: dict[str, Any]) -> dict[str, Any]:
        return await provider.chat(body, timeout=ns.timeout)

    try:
        with tqdm(unit="call", desc="eval", disable=ns.no_progress) as bar:
            def advance(n: int) -> None:
                bar.update(n)

            evaluator = Evaluator(chat, requests, seed=ns.seed, concurrency=max(1, ns.concurrency),
                                  output_limit=shipped_output_limit, progress=advance)
            bar.total = evaluator.total_calls(ns.batch_sizes)
            observation = await evaluator.run(ns.batch_sizes)
    finally:
        await provider.close()
    scorer = await prose_scorer(observation, ns)
    price = ns.price if ns.price is not None else _shipped_prices().get(ns.model)
    return summarise(observation, model=ns.model, upstream=ns.upstream, seed=ns.seed,
                     tolerance_points=ns.tolerance, scorer=scorer, price=price)


def shipped_output_limit(model: str) -> int | None:
    """The model's most output tokens per call from the shipped price table (what the broker caps a merged
    call's budget at without a price configured), None where unknown."""
    price = _shipped_prices().get(model)
    return price.max_output_tokens if price is not None else None


@lru_cache(maxsize=1)
def _shipped_prices() -> PriceTable:
    return PriceTable.build()


async def prose_scorer(observation: Observation, ns: argparse.Namespace) -> Scorer:
    """A scorer with embedding cosines for every prose pair the summary compares (no model if there is none)."""
    pairs: set[tuple[str, str]] = set()

    def record(answer: str, reference: str) -> float:
        if needs_cosine(answer, reference):
            pairs.add((answer, reference))
        return 0.0

    summarise(observation, model=ns.model, upstream=ns.upstream, seed=ns.seed, scorer=record)
    if not pairs:
        return default_scorer
    from mergebroker.providers.local.model import SentenceModelHost

    host = SentenceModelHost()
    texts = sorted({t for pair in pairs for t in pair})
    try:
        vectors = dict(zip(texts, await host.encode(texts, normalize=True)))
    finally:
        host.close()

    def score(answer: str, reference: str) -> float:
        if (answer, reference) in pairs:
            return compare(answer, reference, cosine=float(vectors[answer] @ vectors[reference])).score
        return default_scorer(answer, reference)

    return score
