"""Alert rules: promtool accepts them and their unit tests pass, the PrometheusRule carries
exactly the same rules, the issue's five alerts exist, and each is actionable."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from tests.system.deploy.queries import alert_rules
from tests.system.deploy.support import ALERTS, COMPOSE, K8S, PROMETHEUS, load_yaml

HERE = Path(__file__).resolve().parent
REQUIRED_ALERTS = {
    "ModelExecutorNotHealthy",
    "ModelExecutorAbsent",
    "ModelExecutorEagerFallbackRatioHigh",
    "ModelExecutorKVCacheNearFull",
    "ModelExecutorGraphCaptureFailures",
    "ModelExecutorGRPCErrorRateHigh",
}


def _promtool(promtool: str, *args: str | Path) -> str:
    result = subprocess.run([promtool, *map(str, args)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_promtool_checks_the_rule_file(promtool: str) -> None:
    out = _promtool(promtool, "check", "rules", ALERTS)
    assert f"SUCCESS: {len(REQUIRED_ALERTS)} rules found" in out


def test_promtool_checks_the_prometheus_rule_spec(promtool: str, tmp_path: Path) -> None:
    """What the Prometheus Operator would load from the PrometheusRule, checked as is."""
    spec = load_yaml(K8S / "prometheusrule.yaml")["spec"]
    rules = tmp_path / "prometheusrule-spec.yml"
    rules.write_text(yaml.safe_dump(spec))
    _promtool(promtool, "check", "rules", rules)


def test_alert_unit_tests_pass(promtool: str) -> None:
    """tests/system/deploy/alerts_test.yml: each alert fires on its condition, not before."""
    _promtool(promtool, "test", "rules", HERE / "alerts_test.yml")


def test_unit_tests_cover_every_alert() -> None:
    tests = load_yaml(HERE / "alerts_test.yml")["tests"]
    tested = {case["alertname"] for t in tests for case in t["alert_rule_test"]}
    assert tested == {r["alert"] for r in alert_rules()}


def test_compose_prometheus_config_is_valid(promtool: str, tmp_path: Path) -> None:
    """The compose config, with alerts.yml beside it as the container mounts it."""
    for name in ("prometheus.yml", "alerts.yml"):
        (tmp_path / name).write_text((PROMETHEUS / name).read_text())
    _promtool(promtool, "check", "config", tmp_path / "prometheus.yml")
    mounts = load_yaml(COMPOSE / "docker-compose.yml")["services"]["prometheus"]["volumes"]
    assert "../prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro" in mounts
    assert "../prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in mounts


def test_prometheus_rule_matches_the_rule_file() -> None:
    assert load_yaml(K8S / "prometheusrule.yaml")["spec"] == load_yaml(ALERTS)


def test_required_alerts_exist() -> None:
    names = [r["alert"] for r in alert_rules()]
    assert len(names) == len(set(names)), "duplicate alert names"
    assert set(names) == REQUIRED_ALERTS


def test_alerts_are_actionable() -> None:
    for rule in alert_rules():
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
        assert rule["annotations"]["summary"].strip(), rule["alert"]
        assert len(rule["annotations"]["description"]) > 80, rule["alert"]
        assert "for" in rule, f"{rule['alert']}: no `for`, so one bad scrape pages someone"


def test_up_job_matches_the_scrape_configs() -> None:
    """`up{job="model-executor"}` in the rules needs that job name in both setups."""
    jobs = {c["job_name"] for c in load_yaml(PROMETHEUS / "prometheus.yml")["scrape_configs"]}
    assert "model-executor" in jobs
    # Prometheus Operator: the job label defaults to the Service's name.
    assert load_yaml(K8S / "service.yaml")["metadata"]["name"] == "model-executor"
    assert "jobLabel" not in load_yaml(K8S / "servicemonitor.yaml")["spec"]
    assert any('up{job="model-executor"}' in str(r["expr"]) for r in alert_rules())


def _minutes(duration: str) -> float:
    units = {"s": 1 / 60, "m": 1.0, "h": 60.0}
    return float(duration[:-1]) * units[duration[-1]]


def test_not_healthy_waits_out_the_start_up_budget() -> None:
    """Issue 19: the alert (10 min) fired before Kubernetes gave up on a slow start (15)."""
    deployment = load_yaml(K8S / "deployment.yaml")
    probe = deployment["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
    budget_min = probe["periodSeconds"] * probe["failureThreshold"] / 60
    rule = next(r for r in alert_rules() if r["alert"] == "ModelExecutorNotHealthy")
    assert _minutes(rule["for"]) > budget_min


def test_an_alert_fires_when_no_target_exists() -> None:
    """Issue 19: with every pod gone there is no series for NotHealthy to compare."""
    rule = next(r for r in alert_rules() if r["alert"] == "ModelExecutorAbsent")
    assert str(rule["expr"]).strip() == 'absent(up{job="model-executor"})'
