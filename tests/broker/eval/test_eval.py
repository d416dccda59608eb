"""`mergebroker eval` runs a request set alone and merged against a real (simulated) upstream, reproducibly, and
recommends the largest batch size whose merged answers keep accuracy within the tolerance of alone and whose
calls, tokens and dollars, re-sends included, are below alone."""

from __future__ import annotations

import dataclasses
import json

from mergebroker.broker.cli import build_parser
from mergebroker.broker.eval.cli import eval_command
from mergebroker.broker.eval.report import SizeSummary, recommend
from mergebroker.broker.eval.run import builtin_requests, load_requests, plan_batches
from mergebroker.providers.simulator.server import SimulatorConfig, start_simulator


def _args(sim, out, *extra: str):
    return build_parser().parse_args(["eval", "--upstream", sim.url, "--model", "sim-small", "--out", str(out),
                                      "--no-progress", *extra])


async def test_eval_writes_the_report_and_recommends_the_batch_size_where_accuracy_holds(tmp_path):
    async with await start_simulator(SimulatorConfig(quiz=True, merge_degrade=0.01)) as sim:
        assert await eval_command(_args(sim, tmp_path, "--builtin", "120")) == 0
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["alone_accuracy"] == 1.0 and report["requests"] == 120
    accuracy = {s["batch_size"]: s["accuracy"] for s in report["sizes"]}
    assert accuracy[2] >= 0.98 > accuracy[8]  # the simulator loses ~1 point per extra member
    assert accuracy[2] >= accuracy[4] >= accuracy[8]
    assert report["recommended_max_batch"] in (2, 4)
    calls = {s["batch_size"]: s["merged_calls"] for s in report["sizes"]}
    assert calls == {2: 60, 4: 30, 8: 15}
    markdown = (tmp_path / "eval.md").read_text()
    assert f"`max_batch: {report['recommended_max_batch']}`" in markdown
    assert (tmp_path / "eval.png").stat().st_size > 0


async def test_split_failures_are_counted_by_reason_and_answered_alone(tmp_path):
    async with await start_simulator(SimulatorConfig(quiz=True, drop_block_rate=1.0, seed=3)) as sim:
        assert await eval_command(_args(sim, tmp_path, "--builtin", "40", "--batch-sizes", "4")) == 0
    size = json.loads((tmp_path / "eval.json").read_text())["sizes"][0]
    assert size["failure_reasons"] == {"missing": 10}  # one block dropped from each of the 10 calls
    assert size["split_failure_rate"] == 0.25
    assert size["accuracy"] == 1.0  # the dropped members got their answer alone, as in production
    assert size["calls"] == 20 and size["calls_saved"] == 20


async def test_with_no_merged_batch_within_tolerance_merging_is_not_recommended(tmp_path):
    async with await start_simulator(SimulatorConfig(quiz=True, merge_degrade=0.2)) as sim:
        assert await eval_command(_args(sim, tmp_path, "--builtin", "40", "--batch-sizes", "2,4")) == 0
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["recommended_max_batch"] == 1
    assert "not recommended" in (tmp_path / "eval.md").read_text()


async def test_an_unreachable_upstream_fails_with_a_message_not_a_report(tmp_path, capsys):
    args = build_parser().parse_args(["eval", "--upstream", "http://127.0.0.1:9/v1", "--model", "m", "--out",
                                      str(tmp_path), "--no-progress", "--builtin", "4", "--timeout", "2"])
    assert await eval_command(args) == 1
    assert "every call" in capsys.readouterr().err
    assert not (tmp_path / "eval.json").exists()


def test_the_same_seed_gives_the_same_batches_and_only_compatible_requests_share_one():
    requests = builtin_requests("m", 30)
    assert plan_batches(requests, 4, seed=1) == plan_batches(requests, 4, seed=1) != plan_batches(requests, 4, seed=2)
    assert sorted(i for b in plan_batches(requests, 4, seed=1) for i in b) == list(range(30))
    mixed = load_requests([json.dumps({"messages": [{"role": "system", "content": s},
                                                    {"role": "user", "content": f"q{i}"}], "expected": "x"})
                           for i, s in enumerate(["a", "b"] * 4)], "m")
    for batch in plan_batches(mixed, 8, seed=0):
        assert len({mixed[i].shape.system_prompt for i in batch}) == 1


def test_a_request_file_names_its_bad_line():
    try:
        load_requests(['{"messages": [{"role": "user", "content": "hi"}]}', "not json"], "m")
    except ValueError as exc:
        assert "line 2" in str(exc)
    else:
        raise AssertionError("a bad line was accepted")


def _passing(batch_size: int) -> SizeSummary:
    return SizeSummary(batch_size=batch_size, merged_calls=1, fallbacks=0, split_failure_rate=0.0, failure_reasons={},
                       accuracy=1.0, merged_accuracy=1.0, agreement=1.0, calls=1, calls_saved=1, tokens=1,
                       tokens_saved=1, usd=None, usd_saved=None, latency_p50_s=0.0, latency_p95_s=0.0)


def test_the_recommendation_stops_at_the_first_batch_size_that_fails_a_check():
    two, four, eight = _passing(2), _passing(4), _passing(8)
    assert recommend([two, four, eight])[0] == 8
    best, reason = recommend([two, dataclasses.replace(four, rejected_because="it costs more"), eight])
    assert best == 2 and "a batch of 4 is not: it costs more" in reason
    best, reason = recommend([dataclasses.replace(two, rejected_because="85% failed to split"), four])
    assert best == 1 and reason.startswith("do not merge")


async def test_a_model_that_cannot_split_gets_max_batch_1_and_the_reason(tmp_path, capsys):
    """Its re-sent members score as well as alone, but the merged calls it wastes cost more than alone."""
    async with await start_simulator(SimulatorConfig(quiz=True, split_failure_rate=0.85, seed=1)) as sim:
        assert await eval_command(_args(sim, tmp_path, "--builtin", "40", "--price", "2.5,1.25,10")) == 0
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["recommended_max_batch"] == 1
    assert all(s["accuracy"] == 1.0 for s in report["sizes"])  # as served: the re-sent answers are right
    assert all(s["split_failure_rate"] > 0.5 and s["usd_saved"] < 0 for s in report["sizes"])
    assert "failed to split" in report["reason"] and "failed to split" in capsys.readouterr().err
    assert "failed to split" in (tmp_path / "eval.md").read_text()


async def test_merges_that_cost_more_tokens_than_they_save_are_not_recommended(tmp_path):
    """Short questions without a shared system prompt: the merged format's header and tags cost more
    than the calls save, so merging is a loss in tokens even where every block splits."""
    lines = [json.dumps({"messages": [{"role": "user", "content": f"What is {n} plus {n}?"}],
                         "expected": str(2 * n), "temperature": 0}) for n in range(16)]
    (tmp_path / "set.jsonl").write_text("\n".join(lines))
    async with await start_simulator(SimulatorConfig(quiz=True)) as sim:
        assert await eval_command(_args(sim, tmp_path, "--requests", str(tmp_path / "set.jsonl"),
                                        "--batch-sizes", "2")) == 0
    report = json.loads((tmp_path / "eval.json").read_text())
    (size,) = report["sizes"]
    assert size["split_failure_rate"] == 0 and size["tokens_saved"] < 0
    assert report["recommended_max_batch"] == 1 and "tokens" in size["rejected_because"]
