"""The Grafana dashboard: generated from its table and up to date, with the issue's panels,
datasource and instance variables wired into every query, a sane layout, and queries that
promtool accepts as PromQL."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from tests.system.deploy.promql import usage
from tests.system.deploy.queries import (
    dashboard,
    dashboard_exprs,
    dashboard_panels,
    substitute_grafana_variables,
)
from tests.system.deploy.support import DASHBOARD, GRAFANA

DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
# Issue 7's panels: topic -> (metric, labels it must be broken down by).
REQUIRED_PANELS: dict[str, tuple[str, set[str]]] = {
    "step latency by phase and path": ("model_executor_step_seconds_bucket", {"phase", "path"}),
    "graph replay latency": ("model_executor_graph_replay_seconds_bucket", {"phase"}),
    "eager fallbacks by reason": ("model_executor_eager_fallbacks_total", {"reason"}),
    "captured buckets per phase": ("model_executor_graph_captured_buckets", {"phase"}),
    "capture time per phase": ("model_executor_graph_capture_seconds", {"phase"}),
    "capture memory per phase": ("model_executor_graph_memory_bytes", {"phase"}),
    "KV usage": ("model_executor_kv_usage_ratio", set()),
    "active sequences": ("model_executor_active_sequences", set()),
    "tokens per second": ("model_executor_tokens_total", {"phase"}),
    "gRPC rate": ("grpc_server_handled_total", {"grpc_method"}),
    "gRPC errors by code": ("grpc_server_handled_total", {"grpc_code"}),
}


def _generator() -> ModuleType:
    path = GRAFANA / "generate_dashboard.py"
    spec = importlib.util.spec_from_file_location("generate_dashboard", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being built
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_committed_json_is_the_generated_one() -> None:
    assert DASHBOARD.read_text() == _generator().render(), \
        "stale: run .venv/bin/python deploy/grafana/generate_dashboard.py"


def test_required_panels_are_present() -> None:
    uses = [usage(expr) for expr in dashboard_exprs().values()]
    for topic, (metric, labels) in REQUIRED_PANELS.items():
        assert any(metric in u.metrics and labels <= u.grouping for u in uses), topic


def test_step_latency_has_p50_and_p99() -> None:
    exprs = [e for e in dashboard_exprs().values() if "model_executor_step_seconds_bucket" in e]
    assert any(e.startswith("histogram_quantile(0.5,") for e in exprs)
    assert any(e.startswith("histogram_quantile(0.99,") for e in exprs)


def test_datasource_and_instance_variables() -> None:
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    instance = variables["instance"]
    assert instance["type"] == "query" and instance["datasource"] == DATASOURCE
    assert instance["multi"] and instance["includeAll"] and instance["allValue"] == ".*"


def test_every_query_reads_the_variables() -> None:
    for panel in dashboard_panels():
        assert panel["datasource"] == DATASOURCE, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
            for metric, labels in usage(target["expr"]).matchers.items():
                assert "instance" in labels, f"{panel['title']}: {metric} ignores $instance"
            assert '$instance"' in target["expr"]


def test_layout() -> None:
    panels = dashboard()["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
    assert {p["title"] for p in panels if p["type"] == "row"} >= {"Latency", "CUDA graphs",
                                                                  "gRPC"}


def test_queries_are_valid_promql(promtool: str, tmp_path: Path) -> None:
    """Each query, with Grafana's variables substituted, as a recording rule for promtool."""
    rules: list[dict[str, Any]] = [
        {"record": f"dashboard:query_{i}", "expr": substitute_grafana_variables(expr)}
        for i, expr in enumerate(dashboard_exprs().values())]
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("kind", ["datasources", "dashboards"])
def test_provisioning_files_are_grafana_v1(kind: str) -> None:
    files = sorted((GRAFANA / "provisioning" / kind).glob("*.yml"))
    assert len(files) == 1
    config = yaml.safe_load(files[0].read_text())
    assert config["apiVersion"] == 1
    entries = config["datasources" if kind == "datasources" else "providers"]
    assert len(entries) == 1 and entries[0]["type"] in {"prometheus", "file"}
