"""`mergebroker report` turns a known ledger into the expected rates, savings and costs, as a table and as JSON."""

from __future__ import annotations

import argparse
import asyncio
import io
import json

import pytest

from mergebroker.broker.engine.accounting.ledger import LedgerRecord
from mergebroker.broker.engine.accounting.report import (
    add_report_arguments,
    build_report,
    parse_duration,
    render_json,
    render_table,
    run_report,
)
from mergebroker.broker.engine.accounting.store import SqliteLedgerStore
from mergebroker.merge.pricing import ModelPrice, PriceTable
from mergebroker.merge.usage import largest_remainder

NOW = 1_700_000_000.0
PRICES = PriceTable({"gpt-4o-mini": ModelPrice(input=2.0, cached_input=2.0, output=8.0)})


def rec(request_id: str, tenant: str, **fields: object) -> LedgerRecord:
    base: dict[str, object] = dict(
        ts=NOW - 60, tenant=tenant, tier="standard", model="gpt-4o-mini", batch_id=None, batch_size=1,
        cache="miss", prompt_tokens=0, completion_tokens=0, alone_prompt_tokens=0, tokens_saved=0,
        status=200, latency_ms=100.0, endpoint="chat")
    base.update(fields)
    return LedgerRecord(request_id=request_id, **base)  # type: ignore[arg-type]


def fixture_ledger() -> list[LedgerRecord]:
    """Seven requests in the last hour and one older; numbers chosen so every figure is checkable by hand.

    acme: a merged call of 3 (provider usage 250 prompt / 300 completion; alone 100 each -> 84/83/83,
          saving 50) and a coalesced follower (alone 60 + reused answer 30 -> saves 90).
    beta: a passthrough (50/20), a cache hit (alone 40 + reused answer 10 -> saves 50), a failed call (502).
    """
    shares = largest_remainder(250, [100, 100, 100])
    batch = [rec(f"m{i}", "acme", batch_id="b1", batch_size=3, prompt_tokens=p, completion_tokens=100,
                 alone_prompt_tokens=100, tokens_saved=100 - p) for i, p in enumerate(shares)]
    return batch + [
        rec("follower", "acme", cache="coalesced", batch_size=0, alone_prompt_tokens=60, tokens_saved=90),
        rec("solo", "beta", prompt_tokens=50, completion_tokens=20, alone_prompt_tokens=50),
        rec("hit", "beta", cache="hit", batch_size=0, alone_prompt_tokens=40, tokens_saved=50),
        rec("failed", "beta", status=502, alone_prompt_tokens=30),
        rec("old", "acme", ts=NOW - 7200, prompt_tokens=1000, completion_tokens=1000, alone_prompt_tokens=1000),
    ]


def test_parse_duration_understands_units_and_rejects_nonsense() -> None:
    assert parse_duration("45s") == 45
    assert parse_duration("30m") == 1800
    assert parse_duration("1h") == 3600
    assert parse_duration("2d") == 172_800
    assert parse_duration("1h30m") == 5400
    assert parse_duration("90") == 90
    for bad in ("", "1x", "h", "1h 2", "-5"):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_the_report_computes_rates_savings_and_costs_for_the_window() -> None:
    report = build_report(fixture_ledger(), since_s=3600, tenant=None, prices=PRICES, now=NOW)

    assert report.requests == 7 and report.failed == 1
    assert report.merge_rate == pytest.approx(3 / 7)
    assert report.cache_hit_rate == pytest.approx(1 / 7)
    assert report.coalesce_rate == pytest.approx(1 / 7)
    assert (report.prompt_tokens, report.completion_tokens, report.tokens_saved) == (300, 320, 190)
    assert report.upstream_calls == 3  # the merged batch, the passthrough, the failed call
    assert report.upstream_calls_saved == 4
    assert report.cost_usd == pytest.approx((300 * 2 + 320 * 8) / 1e6)
    assert report.cost_saved_usd == pytest.approx(((50 + 60 + 40) * 2 + (30 + 10) * 8) / 1e6)
    acme, beta = report.tenants
    assert (acme.tenant, acme.requests, acme.merged, acme.coalesced, acme.tokens_saved) == ("acme", 4, 3, 1, 140)
    assert acme.cost_usd == pytest.approx((250 * 2 + 300 * 8) / 1e6)
    assert beta.cost_saved_usd == pytest.approx((40 * 2 + 10 * 8) / 1e6)
    assert report.unpriced_models == ()


def test_the_tenant_filter_and_missing_prices_are_reported() -> None:
    records = fixture_ledger() + [rec("emb", "beta", model="text-embedding-3-small", endpoint="embeddings",
                                      prompt_tokens=500)]
    report = build_report(records, since_s=None, tenant="beta", prices=PRICES, now=NOW)
    assert report.requests == 4 and [t.tenant for t in report.tenants] == ["beta"]
    assert report.cost_usd == pytest.approx((50 * 2 + 20 * 8) / 1e6)
    assert report.unpriced_models == ("text-embedding-3-small",)
    assert "no price for: text-embedding-3-small" in render_table(report)


def test_an_empty_ledger_reports_zero_rates() -> None:
    report = build_report([], since_s=60, tenant=None, prices=PriceTable({}), now=NOW)
    assert (report.requests, report.merge_rate, report.upstream_calls_saved) == (0, 0.0, 0)
    assert json.loads(render_json(report))["tenants"] == []


async def write_fixture(path: str) -> None:
    store = SqliteLedgerStore(path)
    await store.write(fixture_ledger())
    await store.close()


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="mergebroker report")
    add_report_arguments(parser)
    return parser.parse_args(argv)


def test_the_report_command_prints_json_from_a_sqlite_ledger(tmp_path) -> None:
    path = str(tmp_path / "ledger.db")
    asyncio.run(write_fixture(path))
    out = io.StringIO()
    ns = parse(["--ledger", path, "--since", "1h", "--format", "json", "--price", "gpt-4o-mini=2/8"])
    code = run_report(ns, out=out, now=NOW)

    assert code == 0
    doc = json.loads(out.getvalue())
    assert doc["requests"] == 7 and doc["upstream_calls_saved"] == 4 and doc["tokens_saved"] == 190
    assert doc["merge_rate"] == pytest.approx(3 / 7)
    assert doc["cost_usd"] == pytest.approx(0.00316)
    assert doc["cost_saved_usd"] == pytest.approx(0.00062)
    assert doc["since_ts"] == NOW - 3600
    assert [t["tenant"] for t in doc["tenants"]] == ["acme", "beta"]


def test_the_report_command_prints_a_table_for_one_tenant(tmp_path) -> None:
    path = str(tmp_path / "ledger.db")
    asyncio.run(write_fixture(path))
    out = io.StringIO()
    ns = parse(["--ledger", path, "--since", "1h", "--tenant", "acme", "--price", "gpt-4o-mini=2/8"])
    assert run_report(ns, out=out, now=NOW) == 0

    table = out.getvalue()
    assert "tenant: acme" in table
    assert "75.0%" in table  # merge rate: 3 of acme's 4 requests
    assert "25.0%" in table  # coalesce rate
    assert "$0.0029" in table  # acme's cost: 250 * $2/M + 300 * $8/M
    assert "beta" not in table


def test_the_report_command_fails_cleanly_without_a_ledger(tmp_path, capsys) -> None:
    ns = parse(["--ledger", str(tmp_path / "missing.db")])
    assert run_report(ns) == 1
    assert "no ledger" in capsys.readouterr().err
    assert not (tmp_path / "missing.db").exists()


def test_bad_prices_and_durations_are_argument_errors() -> None:
    for argv in (["--ledger", "x", "--price", "gpt-4o=abc"], ["--ledger", "x", "--since", "soon"]):
        with pytest.raises(SystemExit) as info:
            parse(argv)
        assert info.value.code == 2



def test_shadow_calls_are_reported_apart_with_their_cost() -> None:
    records = fixture_ledger() + [rec("shadow-1", "acme", endpoint="shadow", prompt_tokens=100, completion_tokens=50),
                                  rec("shadow-2", "beta", endpoint="shadow", prompt_tokens=10, completion_tokens=5)]
    report = build_report(records, since_s=3600, tenant=None, prices=PRICES, now=NOW)
    assert report.requests == 7 and report.upstream_calls == 3  # the request figures are unchanged
    assert (report.shadow_calls, report.shadow_tokens) == (2, 165)
    assert report.shadow_cost_usd == pytest.approx((110 * 2 + 55 * 8) / 1e6)
    assert "shadow calls" in render_table(report)
    assert "shadow calls" not in render_table(build_report(fixture_ledger(), prices=PRICES, now=NOW))


def test_dollars_the_broker_recorded_are_reported_as_they_are_with_the_bill_against_sending_alone() -> None:
    """A record with dollars is not re-priced: its cached part and its alone estimate came from the broker."""
    records = [rec("a", "acme", batch_id="b", batch_size=2, prompt_tokens=500, completion_tokens=80,
                   actual_usd=0.002, alone_usd=0.005),
               rec("b", "acme", batch_id="b", batch_size=2, prompt_tokens=500, completion_tokens=80,
                   actual_usd=0.002, alone_usd=0.005)]
    report = build_report(records, since_s=None, tenant=None, prices=PRICES, now=NOW)
    assert report.cost_usd == pytest.approx(0.004) and report.alone_usd == pytest.approx(0.010)
    assert report.cost_saved_usd == pytest.approx(0.006)
    assert report.tenants[0].alone_usd == pytest.approx(0.010)
    assert "the bill is 0.40x of sending alone" in render_table(report)


def test_a_cached_price_on_the_command_line_prices_old_records_with_their_cached_part() -> None:
    from mergebroker.broker.engine.accounting.report import parse_price
    from mergebroker.merge.pricing import PriceTable

    model, entry = parse_price("m=2.5/1.25/10")
    table = PriceTable.build({model: entry})
    records = [rec("x", "t", model="m", prompt_tokens=2048, cached_tokens=1024, completion_tokens=100)]
    report = build_report(records, since_s=None, tenant=None, prices=table, now=NOW)
    assert report.cost_usd == pytest.approx((1024 * 2.5 + 1024 * 1.25 + 100 * 10) / 1e6)
