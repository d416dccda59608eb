"""`mergebroker eval` runs a request set alone and merged against a real (simulated) upstream, reproducibly, and
recommends the largest batch size that keeps accuracy within the tolerance of alone."""

from __future__ import annotations

import json

from mergebroker.broker.cli import build_parser
from mergebroker.broker.eval.cli import eval_command
from mergebroker.broker.eval.report import recommend
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


def test_the_recommendation_stops_at_the_first_batch_size_outside_the_tolerance():
    assert recommend(0.9, {2: 0.89, 4: 0.87, 8: 0.89}, 2.0) == 2
    assert recommend(0.9, {2: 0.9, 4: 0.885, 8: 0.88}, 2.0) == 8
    assert recommend(1.0, {2: 0.95}, 2.0) == 1
