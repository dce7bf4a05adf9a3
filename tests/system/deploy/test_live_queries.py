"""A real Prometheus (Debian's ``prometheus`` package) scrapes the live ``tiny`` servers (one
process, and two tensor-parallel ranks) with
deploy/prometheus/alerts.yml loaded: every dashboard query must evaluate to data, every
alert rule must evaluate without error, and on a healthy CPU server under light traffic
only the eager-fallback condition holds (every CPU step runs eagerly: reason no_cuda).
This catches what name checks cannot: label sets that do not match across a binary
operator, or a query that is valid but always empty.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.system.deploy.queries import (
    alert_rules,
    dashboard_exprs,
    substitute_grafana_variables,
    variable_queries,
)
from tests.system.deploy.support import (
    ALERTS,
    LiveServer,
    drive_traffic,
    free_port,
    stop_process,
    wait_for,
)

SCRAPE_INTERVAL_S = 1
# On a healthy CPU server, the only alert condition that holds (alerts.yml says why).
TRUE_ON_CPU = {"ModelExecutorEagerFallbackRatioHigh"}


@dataclass
class Prometheus:
    url: str

    def get(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=10) as response:
            body = json.loads(response.read().decode())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return list(self.get("/api/v1/query", query=expr)["result"])


@pytest.fixture(scope="module")
def prometheus(live_server: LiveServer, live_tp_server: LiveServer, prometheus_bin: str,
               prometheus_dir: Path) -> Iterator[Prometheus]:
    """Scraping a one-process and a tensor-parallel server (the dashboard's
    tensor-parallelism row reads series only the latter exports)."""
    servers = (live_server, live_tp_server)
    config = {
        "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s",
                   "evaluation_interval": f"{SCRAPE_INTERVAL_S}s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [{"job_name": "model-executor", "static_configs": [
            {"targets": [f"127.0.0.1:{s.metrics_port}" for s in servers]}]}],
    }
    config_path = prometheus_dir / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config))
    port = free_port()
    log = prometheus_dir / "prometheus.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [prometheus_bin, f"--config.file={config_path}",
             f"--storage.tsdb.path={prometheus_dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=out, stderr=subprocess.STDOUT, cwd=prometheus_dir)
    prom = Prometheus(f"http://127.0.0.1:{port}")
    try:
        wait_for(lambda: len(prom.query('up{job="model-executor"} == 1')) == len(servers),
                 30, "Prometheus to scrape the servers", process, log)
        for server in servers:
            drive_traffic(server.target)
        time.sleep(3 * SCRAPE_INTERVAL_S)  # the traffic's counters reach the TSDB
        yield prom
    finally:
        stop_process(process)


@pytest.fixture(scope="module")
def prometheus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("prometheus")


def test_every_dashboard_query_returns_data(prometheus: Prometheus) -> None:
    empty = {source: expr for source, expr in dashboard_exprs().items()
             if not prometheus.query(substitute_grafana_variables(expr))}
    assert not empty, f"dashboard queries with no data: {json.dumps(empty, indent=2)}"


def test_template_variables_have_values(prometheus: Prometheus) -> None:
    for name, (metric, label) in variable_queries().items():
        values = prometheus.get(f"/api/v1/label/{label}/values", **{"match[]": metric})
        assert values, f"variable {name} would offer no {label} values"


def test_alert_rules_evaluate_cleanly(prometheus: Prometheus) -> None:
    def evaluated() -> list[dict[str, Any]] | None:
        rules = [r for g in prometheus.get("/api/v1/rules")["groups"] for r in g["rules"]]
        done = all(not r["lastEvaluation"].startswith("0001") for r in rules)
        return rules if done and rules else None

    deadline = time.monotonic() + 15
    while (rules := evaluated()) is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert rules is not None, "the alert rules were never evaluated"
    assert {r["name"] for r in rules} == {r["alert"] for r in alert_rules()}
    broken = {r["name"]: r.get("lastError") for r in rules if r["health"] != "ok"}
    assert not broken, broken


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda r: r["alert"])
def test_alert_condition_on_a_healthy_cpu_server(prometheus: Prometheus,
                                                 rule: dict[str, Any]) -> None:
    result = prometheus.query(rule["expr"])
    if rule["alert"] in TRUE_ON_CPU:
        assert result, f"{rule['alert']}: expected to hold on CPU, got nothing"
        assert {s["metric"]["job"] for s in result} == {"model-executor"}
    else:
        assert not result, f"{rule['alert']} would fire on a healthy server: {result}"
