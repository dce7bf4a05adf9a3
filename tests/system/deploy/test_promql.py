"""The PromQL name finder that the metric-existence tests rely on."""

from __future__ import annotations

from tests.system.deploy.promql import usage


def test_finds_metrics_matchers_and_grouping_labels() -> None:
    u = usage('histogram_quantile(0.99, sum by (le, phase) (rate('
              'model_executor_step_seconds_bucket{instance=~"$instance", path!="x"}'
              '[$__rate_interval]))) > 1e-3')
    assert u.metrics == {"model_executor_step_seconds_bucket"}
    assert u.matchers["model_executor_step_seconds_bucket"] == {"instance", "path"}
    assert u.grouping == {"le", "phase"}


def test_ignores_keywords_functions_strings_and_ranges() -> None:
    u = usage('(sum without (reason) (rate(a_total{reason!="graphs_disabled"}[10m]))'
              " / on (job) group_left (phase) b) > 0.2 or up{job='x'} == bool 0"
              " unless c offset 5m")
    assert u.metrics == {"a_total", "b", "up", "c"}
    assert u.grouping == {"reason", "job", "phase"}
    assert u.matchers["up"] == {"job"}


def test_label_values_in_strings_are_not_names() -> None:
    u = usage('x{grpc_code=~"UNKNOWN|INTERNAL", grpc_service="model_executor.v1.Executor"}')
    assert u.metrics == {"x"}
    assert u.matchers["x"] == {"grpc_code", "grpc_service"}
