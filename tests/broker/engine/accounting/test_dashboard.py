"""The Grafana dashboard and Prometheus configs are well-formed and query only metric names the broker exports."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from mergebroker.broker.engine.ground.lockfree_metrics import HistogramChild, LockFreeCounter, LockFreeHistogram
from mergebroker.broker.engine.ground.metrics import Metrics
from tests.helpers.paths import REPO

CONFIGS = REPO / "configs"
METRIC_NAME = re.compile(r"mergebroker_[a-z_]+")


def exported_sample_names() -> set[str]:
    """Every sample name a broker's /metrics shows once each labelled family holds one series."""
    metrics = Metrics()
    for family in vars(metrics).values():
        if not isinstance(family, Counter | Gauge | Histogram | LockFreeCounter | LockFreeHistogram):
            continue
        child = family.labels(*["x"] * len(family._labelnames)) if family._labelnames else family
        if isinstance(child, Gauge):
            child.set(1)
        elif isinstance(child, Histogram | LockFreeHistogram | HistogramChild):
            child.observe(1)
        else:
            child.inc()
    text = metrics.render().decode()
    return {sample.name for fam in text_string_to_metric_families(text) for sample in fam.samples}


def dashboard() -> dict:
    return json.loads((CONFIGS / "grafana" / "mergebroker.json").read_text())


def panels(dash: dict) -> list[dict]:
    found = []
    for panel in dash["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


def dashboard_exprs(dash: dict) -> list[str]:
    return [t["expr"] for p in panels(dash) for t in p.get("targets", [])]


def alert_rules() -> list[dict]:
    doc = yaml.safe_load((CONFIGS / "prometheus" / "alerts.yml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def balanced(expr: str) -> bool:
    stack, pairs = [], {")": "(", "]": "[", "}": "{"}
    for ch in re.sub(r'"[^"]*"', '""', expr):
        if ch in "([{":
            stack.append(ch)
        elif ch in pairs and (not stack or stack.pop() != pairs[ch]):
            return False
    return not stack


def test_the_dashboard_is_an_importable_grafana_dashboard_whose_panels_all_have_titles() -> None:
    dash = dashboard()
    assert dash["schemaVersion"] >= 36 and dash["title"] and dash["uid"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert "mergebroker_" in variables["tier"]["definition"] and variables["tier"]["includeAll"]
    for panel in panels(dash):
        assert panel.get("title"), f"panel {panel.get('id')} has no title"
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}"
            assert panel["targets"] and all(t["expr"] for t in panel["targets"])
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids))


def test_dashboard_panels_do_not_overlap() -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in panels(dashboard()):
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]


def test_every_metric_the_dashboard_queries_is_exported_by_the_broker() -> None:
    exported = exported_sample_names()
    used = {name for expr in dashboard_exprs(dashboard()) for name in METRIC_NAME.findall(expr)}
    assert used, "no metric names found in the dashboard"
    assert used <= exported, f"not exported: {sorted(used - exported)}"


def test_every_metric_the_alert_rules_query_is_exported_by_the_broker() -> None:
    exported = exported_sample_names()
    used = {name for rule in alert_rules() for name in METRIC_NAME.findall(rule["expr"])}
    assert used and used <= exported, f"not exported: {sorted(used - exported)}"


def test_the_dashboard_covers_the_broker_signals() -> None:
    used = " ".join(dashboard_exprs(dashboard()))
    for name in ("mergebroker_requests_total", "mergebroker_merged_requests_total", "mergebroker_batch_size_sum",
                 "mergebroker_upstream_calls_saved_total", "mergebroker_tokens_saved_total",
                 "mergebroker_cache_events_total", "mergebroker_embedding_cache_events_total",
                 "mergebroker_queue_depth", "mergebroker_queue_wait_seconds_bucket",
                 "mergebroker_request_latency_seconds_bucket", "mergebroker_split_fallback_total",
                 "mergebroker_breaker_state", "mergebroker_degraded", "mergebroker_fast_fail_total",
                 "mergebroker_rejected_total", "mergebroker_forced_flush_total"):
        assert name in used, name
    assert 'reason="rate_limited"' in used
    assert all(balanced(expr) for expr in dashboard_exprs(dashboard()))


def test_alert_rules_are_valid_prometheus_rules_for_the_documented_conditions() -> None:
    rules = alert_rules()
    names = {rule["alert"] for rule in rules}
    assert {"MergebrokerQueueFull", "MergebrokerForcedFlushes", "MergebrokerBreakerOpen",
            "MergebrokerSplitFallbackHigh", "MergebrokerMergeRateCollapsed",
            "MergebrokerLatencyP99OverSLO"} <= names
    assert len(names) == len(rules)
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}
        assert re.fullmatch(r"\d+[smhd]", rule["for"]), rule["alert"]
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}
        assert rule["annotations"]["summary"]
        assert balanced(rule["expr"]), rule["alert"]


def test_prometheus_config_scrapes_the_brokers_and_loads_the_alert_rules() -> None:
    doc = yaml.safe_load((CONFIGS / "prometheus" / "prometheus.yml").read_text())
    assert doc["rule_files"] == ["alerts.yml"]
    (job,) = [j for j in doc["scrape_configs"] if j["job_name"] == "mergebroker"]
    assert job["metrics_path"] == "/metrics"
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert len(targets) >= 2 and all(re.fullmatch(r"[\w.-]+:\d+", t) for t in targets)


@pytest.mark.parametrize("expr,ok", [("sum(rate(a[5m]))", True), ("sum(rate(a[5m])", False), ('a{b=")"}', True)])
def test_the_bracket_check_used_above_can_fail(expr: str, ok: bool) -> None:
    assert balanced(expr) is ok


def test_compose_provisions_grafana_with_the_dashboard_and_the_prometheus_data_source() -> None:
    compose = yaml.safe_load((CONFIGS / "docker-compose.yml").read_text())["services"]
    mounts = {v.split(":")[0]: v.split(":")[1] for v in compose["grafana"]["volumes"]}
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    dashboards_dir = mounts["./grafana/mergebroker.json"].rsplit("/", 1)[0]
    provider = yaml.safe_load((CONFIGS / "grafana/provisioning/dashboards/mergebroker.yml").read_text())
    assert [p["options"]["path"] for p in provider["providers"]] == [dashboards_dir]
    sources = yaml.safe_load((CONFIGS / "grafana/provisioning/datasources/prometheus.yml").read_text())
    (source,) = sources["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"]
    assert source["url"].split("//")[1].split(":")[0] in compose


def test_compose_runs_two_frontends_and_two_workers_in_cluster_mode_all_scraped() -> None:
    compose = yaml.safe_load((CONFIGS / "docker-compose.yml").read_text())["services"]
    workers = [name for name, s in compose.items() if s.get("command", [None])[0] == "worker"]
    frontends = [name for name, s in compose.items() if s.get("build") and name not in workers]
    assert len(workers) == 2 and len(frontends) == 2
    for name in workers + frontends:
        assert compose[name]["environment"]["MERGEBROKER_CLUSTER__ENABLED"] == "true"
    doc = yaml.safe_load((CONFIGS / "prometheus" / "prometheus.yml").read_text())
    targets = {t.split(":")[0] for job in doc["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert set(workers + frontends) <= targets


async def test_a_broker_that_served_only_plain_chats_exports_every_family_the_dashboard_queries(
        start_broker) -> None:
    """No panel shows "No data" on a healthy broker: every family starts at zero (cluster families aside,
    which cluster processes export)."""
    broker = await start_broker({"merge": {"embedder": "none"}})
    status, _, _ = await broker.chat("Hello there")
    assert status == 200
    async with broker.http.get("/metrics") as resp:
        text = await resp.text()
    exported = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    used = {name for expr in dashboard_exprs(dashboard()) for name in METRIC_NAME.findall(expr)}
    missing = {name for name in used - exported if not name.startswith("mergebroker_cluster_")}
    assert not missing, f"absent until their first event: {sorted(missing)}"
