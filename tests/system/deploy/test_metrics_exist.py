"""Every metric and label the dashboard and the alert rules use is exported by a live
``tiny`` server started through the CLI, so neither can silently rot when metrics change.
"""

from __future__ import annotations

import subprocess

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.system.deploy.promql import usage
from tests.system.deploy.queries import (
    SYNTHETIC_METRICS,
    TARGET_LABELS,
    all_exprs,
    variable_queries,
)
from tests.system.deploy.support import LiveServer, drive_traffic


@pytest.fixture(scope="module")
def exported(live_server: LiveServer, live_tp_server: LiveServer) -> dict[str, set[str]]:
    """Series name (``_total``, ``_bucket``, ... included) -> its label names, after traffic
    (gRPC series only appear once a call has been handled), over a one-process and a
    tensor-parallel server (some series exist only there)."""
    series: dict[str, set[str]] = {}
    for server in (live_server, live_tp_server):
        drive_traffic(server.target)
        for family in text_string_to_metric_families(server.scrape()):
            for sample in family.samples:
                series.setdefault(sample.name, set()).update(sample.labels)
    return series


def test_scrape_has_the_service_metrics(exported: dict[str, set[str]]) -> None:
    assert "model_executor_healthy" in exported
    assert "grpc_server_handled_total" in exported
    assert {"grpc_service", "grpc_method", "grpc_code"} <= exported["grpc_server_handled_total"]


@pytest.mark.parametrize(("source", "expr"), sorted(all_exprs().items()))
def test_query_uses_exported_metrics_and_labels(
        source: str, expr: str, exported: dict[str, set[str]]) -> None:
    u = usage(expr)
    assert u.metrics, f"{source}: no metric found in {expr!r}"
    missing = sorted(m for m in u.metrics if m not in exported and m not in SYNTHETIC_METRICS)
    assert not missing, f"{source}: metrics not in /metrics: {missing}"
    for metric, labels in u.matchers.items():
        known = exported.get(metric, set()) | TARGET_LABELS
        unknown = sorted(labels - known)
        assert not unknown, f"{source}: {metric} has no label(s) {unknown}"
    in_expr = set().union(*(exported.get(m, set()) for m in u.metrics)) | TARGET_LABELS
    unknown = sorted(u.grouping - in_expr)
    assert not unknown, f"{source}: grouping label(s) {unknown} on none of {sorted(u.metrics)}"


def test_template_variables_use_exported_series(exported: dict[str, set[str]]) -> None:
    queries = variable_queries()
    assert set(queries) == {"instance"}
    for name, (metric, label) in queries.items():
        assert metric in exported, f"variable {name}: {metric} not exported"
        assert label in exported[metric] | TARGET_LABELS


def test_promtool_accepts_the_exposition(live_server: LiveServer, promtool: str) -> None:
    """promtool's metric lint (naming, units, counter suffixes) on the real /metrics."""
    result = subprocess.run([promtool, "check", "metrics"], input=live_server.scrape(),
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
