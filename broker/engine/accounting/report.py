"""`mergebroker report`: what merging, coalescing and caching saved, read from the usage ledger.

`build_report` is a pure aggregation over `LedgerRecord`s; `render_table` / `render_json` present it;
`add_report_arguments` + `run_report` are the thin command-line layer the CLI wires in.

Definitions (all over the records in the window and tenant filter):
- merge rate: requests answered by a merged call (cache miss, `batch_size > 1`) / all requests;
  cache hit rate and coalesce rate likewise for `cache == "hit"` / `"coalesced"`.
- upstream calls: members of one batch share one call; a miss without a batch id is its own call;
  hits, coalesced followers and requests refused before any call (`batch_size == 0`) make none. A Batch
  API line carries the batch id of the compacted call that answered it, and every line that call answered
  (identical lines sent once included) is one of its members, so it counts once and its lines as merged.
- upstream calls saved: requests served (by a call or a reused answer) minus upstream calls.
- cost: the dollars the broker recorded for each request (`actual_usd`: its reported usage, cached part
  included, at the model's price) and `alone_usd` (what it would have cost sent alone with the provider's
  prompt cache); cost saved is alone minus actual. A record from an older broker, without dollars, is
  priced here from its tokens (the shipped price table, under `--price`), its saving from
  `prompt_tokens_saved` and `completion_tokens_saved`. Models without a price cost 0 and are listed in
  `unpriced_models`.
- shadow calls (`endpoint == "shadow"`, merge-quality checks by `broker.engine.chat.shadow`) are no requests: they are
  left out of every figure above and reported on their own (`shadow_calls`, `shadow_tokens`, `shadow_cost_usd`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import sys
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TextIO

from mergebroker.broker.engine.accounting.ledger import LedgerRecord
from mergebroker.broker.engine.accounting.store import open_store
from mergebroker.merge.pricing import PriceTable, cost_usd

_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


@dataclass(frozen=True)
class TenantTotals:
    """One tenant's share of the report."""

    tenant: str
    requests: int
    merged: int
    cache_hits: int
    coalesced: int
    prompt_tokens: int
    completion_tokens: int
    tokens_saved: int
    cost_usd: float
    cost_saved_usd: float
    alone_usd: float = 0.0  # what its requests would have cost sent alone


@dataclass(frozen=True)
class Report:
    """Aggregated ledger figures for one window (`since_ts` .. `until_ts`, epoch seconds)."""

    since_ts: float | None
    until_ts: float
    tenant: str | None
    requests: int
    merged: int
    cache_hits: int
    coalesced: int
    failed: int
    merge_rate: float
    cache_hit_rate: float
    coalesce_rate: float
    prompt_tokens: int
    completion_tokens: int
    tokens_saved: int
    upstream_calls: int
    upstream_calls_saved: int
    cost_usd: float
    cost_saved_usd: float
    tenants: tuple[TenantTotals, ...]
    unpriced_models: tuple[str, ...]
    shadow_calls: int = 0  # merge-quality checks (broker.shadow): not requests, billed on their own
    shadow_tokens: int = 0
    shadow_cost_usd: float = 0.0
    alone_usd: float = 0.0  # what the requests would have cost sent alone with the provider's prompt cache


def parse_duration(text: str) -> float:
    """Seconds in a duration like "45s", "30m", "1h", "2d", "1w" or "1h30m"; a bare number is seconds."""
    text = text.strip().lower()
    try:
        seconds = float(text)
    except ValueError:
        parts = _DURATION.findall(text)
        if not parts or "".join(n + u for n, u in parts) != text:
            raise ValueError(f"not a duration: {text!r} (use e.g. 45s, 30m, 1h, 2d)") from None
        seconds = sum(float(n) * _UNIT_S[u] for n, u in parts)
    if seconds < 0:
        raise ValueError(f"negative duration: {text!r}")
    return seconds


def parse_price(text: str) -> tuple[str, dict[str, float]]:
    """`MODEL=IN/OUT` or `MODEL=IN/CACHED/OUT` (USD per 1M input, cached input, output tokens) -> (model, the
    price entry as the config's `pricing` section spells it); without a cached price, cached input costs IN."""
    model, sep, price = text.rpartition("=")
    parts = price.split("/")
    try:
        if not (sep and model and len(parts) in (2, 3)):
            raise ValueError
        values = [float(part) for part in parts]
        if any(v < 0 for v in values):
            raise ValueError
    except ValueError:
        raise ValueError(f"not a price: {text!r} (use MODEL=IN/OUT or MODEL=IN/CACHED/OUT, USD per 1M tokens)") from None
    inp, out = values[0], values[-1]
    return model, {"input": inp, "cached_input": values[1] if len(values) == 3 else inp, "output": out}


def build_report(records: Iterable[LedgerRecord], *, since_s: float | None = None, tenant: str | None = None,
                 prices: PriceTable, now: float | None = None) -> Report:
    """Aggregate `records` from the last `since_s` seconds before `now` (None: wall clock) for `tenant`."""
    until = time.time() if now is None else now
    since_ts = None if since_s is None else until - since_s
    window = [r for r in records
              if (since_ts is None or r.ts >= since_ts) and (tenant is None or r.tenant == tenant)]
    chosen = [r for r in window if r.endpoint != "shadow"]
    shadow = [r for r in window if r.endpoint == "shadow"]
    by_tenant: dict[str, list[LedgerRecord]] = defaultdict(list)
    for rec in chosen:
        by_tenant[rec.tenant].append(rec)
    tenants = tuple(_totals(name, by_tenant[name], prices) for name in sorted(by_tenant))
    calls = _upstream_calls(chosen)
    served = sum(1 for r in chosen if r.made_call or r.cache != "miss")
    n = len(chosen)
    return Report(
        since_ts=since_ts, until_ts=until, tenant=tenant, requests=n,
        merged=sum(t.merged for t in tenants), cache_hits=sum(t.cache_hits for t in tenants),
        coalesced=sum(t.coalesced for t in tenants), failed=sum(1 for r in chosen if r.status >= 400),
        merge_rate=_ratio(sum(t.merged for t in tenants), n),
        cache_hit_rate=_ratio(sum(t.cache_hits for t in tenants), n),
        coalesce_rate=_ratio(sum(t.coalesced for t in tenants), n),
        prompt_tokens=sum(t.prompt_tokens for t in tenants),
        completion_tokens=sum(t.completion_tokens for t in tenants),
        tokens_saved=sum(t.tokens_saved for t in tenants),
        upstream_calls=calls, upstream_calls_saved=served - calls,
        cost_usd=sum(t.cost_usd for t in tenants), cost_saved_usd=sum(t.cost_saved_usd for t in tenants),
        alone_usd=sum(t.alone_usd for t in tenants), tenants=tenants,
        unpriced_models=tuple(sorted({r.model for r in window if r.actual_usd is None and prices.get(r.model) is None})),
        shadow_calls=len(shadow), shadow_tokens=sum(r.prompt_tokens + r.completion_tokens for r in shadow),
        shadow_cost_usd=_totals("shadow", shadow, prices).cost_usd,
    )


def _dollars(rec: LedgerRecord, prices: PriceTable) -> tuple[float, float]:
    """(actual, alone) dollars of one record: as the broker recorded them, else priced from its tokens."""
    if rec.actual_usd is not None:
        return rec.actual_usd, rec.alone_usd if rec.alone_usd is not None else rec.actual_usd
    price = prices.get(rec.model)
    if price is None:
        return 0.0, 0.0
    cached = min(rec.cached_tokens, rec.prompt_tokens)
    actual = cost_usd(price, rec.prompt_tokens, cached, min(rec.cache_write_tokens, rec.prompt_tokens - cached),
                      rec.completion_tokens)
    saved = (rec.prompt_tokens_saved * price.input + rec.completion_tokens_saved * price.output) / 1e6
    return actual, actual + saved


def _totals(tenant: str, records: list[LedgerRecord], prices: PriceTable) -> TenantTotals:
    cost = alone = 0.0
    for rec in records:
        actual, rec_alone = _dollars(rec, prices)
        cost += actual
        alone += rec_alone
    saved = alone - cost
    return TenantTotals(
        tenant=tenant, requests=len(records), merged=sum(1 for r in records if r.merged),
        cache_hits=sum(1 for r in records if r.cache == "hit"),
        coalesced=sum(1 for r in records if r.cache == "coalesced"),
        prompt_tokens=sum(r.prompt_tokens for r in records),
        completion_tokens=sum(r.completion_tokens for r in records),
        tokens_saved=sum(r.tokens_saved for r in records), cost_usd=cost, cost_saved_usd=saved, alone_usd=alone)


def _upstream_calls(records: Iterable[LedgerRecord]) -> int:
    return len({r.batch_id if r.batch_id else ("solo", r.request_id) for r in records if r.made_call})


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def render_json(report: Report) -> str:
    """The report as a JSON document (costs in USD, rates as fractions)."""
    return json.dumps(dataclasses.asdict(report), indent=2, sort_keys=True)


def render_table(report: Report) -> str:
    """The report as a plain-text table for a terminal."""
    since = "the beginning" if report.since_ts is None else _iso(report.since_ts)
    lines = [
        f"mergebroker usage from {since} to {_iso(report.until_ts)}, tenant: {report.tenant or 'all'}",
        "",
        f"  requests              {report.requests:>12,}   ({report.failed:,} failed)",
        f"  merge rate            {report.merge_rate:>12.1%}   ({report.merged:,} answered by merged calls)",
        f"  cache hit rate        {report.cache_hit_rate:>12.1%}   ({report.cache_hits:,})",
        f"  coalesce rate         {report.coalesce_rate:>12.1%}   ({report.coalesced:,})",
        f"  upstream calls        {report.upstream_calls:>12,}   ({report.upstream_calls_saved:,} saved)",
        f"  prompt tokens         {report.prompt_tokens:>12,}",
        f"  completion tokens     {report.completion_tokens:>12,}",
        f"  tokens saved          {report.tokens_saved:>12,}",
        f"  cost                  {_usd(report.cost_usd):>12}",
        f"  cost sent alone       {_usd(report.alone_usd):>12}   (each request alone, with the provider's prompt cache)",
        f"  cost saved            {_usd(report.cost_saved_usd):>12}   ({_ratio_text(report.cost_usd, report.alone_usd)})",
        "",
    ]
    if report.shadow_calls:
        lines[-1:-1] = [f"  shadow calls          {report.shadow_calls:>12,}   ({report.shadow_tokens:,} tokens, "
                        f"{_usd(report.shadow_cost_usd)}; merge-quality checks, not in the figures above)"]
    header = ("tenant", "requests", "merged", "hits", "coalesced", "prompt", "completion", "saved", "cost",
              "cost saved")
    rows = [(t.tenant, f"{t.requests:,}", f"{t.merged:,}", f"{t.cache_hits:,}", f"{t.coalesced:,}",
             f"{t.prompt_tokens:,}", f"{t.completion_tokens:,}", f"{t.tokens_saved:,}", _usd(t.cost_usd),
             _usd(t.cost_saved_usd)) for t in report.tenants]
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    for row in (header, *rows):
        lines.append("  " + row[0].ljust(widths[0]) + "".join(
            "  " + cell.rjust(w) for cell, w in zip(row[1:], widths[1:])))
    if report.unpriced_models:
        lines += ["", "  no price for: " + ", ".join(report.unpriced_models) + " (counted as $0)"]
    return "\n".join(lines) + "\n"


def _ratio_text(actual: float, alone: float) -> str:
    return f"the bill is {actual / alone:.2f}x of sending alone" if alone > 0 else "nothing priced"


def _usd(amount: float) -> str:
    return f"${amount:,.4f}"


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _duration_arg(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _price_arg(text: str) -> tuple[str, dict[str, float]]:
    try:
        return parse_price(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `mergebroker report` options to `parser`."""
    parser.add_argument("--ledger", required=True, metavar="PATH",
                        help="the ledger: a SQLite file, or a postgresql:// DSN")
    parser.add_argument("--since", type=_duration_arg, default=None, metavar="DURATION",
                        help="only the last DURATION (45s, 30m, 1h, 2d); default: everything")
    parser.add_argument("--tenant", default=None, help="only this tenant")
    parser.add_argument("--format", choices=("table", "json"), default="table", help="output format")
    parser.add_argument("--price", type=_price_arg, action="append", default=[], metavar="MODEL=IN[/CACHED]/OUT",
                        help="USD per 1M input (cached input) and output tokens for MODEL, over the shipped price "
                             "table; prices records written without dollars (repeatable)")


def run_report(ns: argparse.Namespace, *, out: TextIO | None = None, now: float | None = None) -> int:
    """Run `mergebroker report` with parsed arguments; returns the exit code (1 when the ledger can't be read)."""
    out = sys.stdout if out is None else out
    is_dsn = ns.ledger.startswith(("postgres://", "postgresql://"))
    if not is_dsn and not os.path.isfile(ns.ledger):
        print(f"mergebroker report: no ledger at {ns.ledger}", file=sys.stderr)
        return 1
    until = time.time() if now is None else now
    since_ts = None if ns.since is None else until - ns.since
    try:
        records = asyncio.run(_load(ns.ledger, since_ts, ns.tenant))
    except Exception as exc:  # the CLI's boundary: any failure to read becomes a message and exit code 1
        print(f"mergebroker report: cannot read the ledger: {exc}", file=sys.stderr)
        return 1
    report = build_report(records, since_s=ns.since, tenant=ns.tenant, prices=PriceTable.build(dict(ns.price)), now=until)
    out.write(render_json(report) + "\n" if ns.format == "json" else render_table(report))
    return 0


async def _load(target: str, since_ts: float | None, tenant: str | None) -> list[LedgerRecord]:
    store = open_store(target)
    try:
        return await store.query(since_ts, tenant)
    finally:
        await store.close()
