"""Every PromQL expression the deployment ships: alert rules and dashboard queries."""

from __future__ import annotations

import json
import re
from typing import Any

from tests.system.deploy.support import ALERTS, DASHBOARD, load_yaml

# Labels Prometheus attaches at scrape time (static configs and the Prometheus Operator's
# endpoint discovery), which the service itself never exports.
TARGET_LABELS = frozenset({"job", "instance", "namespace", "pod", "service", "endpoint",
                           "container"})
# Series Prometheus synthesises for every target.
SYNTHETIC_METRICS = frozenset({"up"})

_LABEL_VALUES = re.compile(r"^label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,\s*(\w+)\s*\)$")


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in load_yaml(ALERTS)["groups"] for rule in group["rules"]]


def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def dashboard_panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def dashboard_exprs() -> dict[str, str]:
    """'panel title / refId' -> expr, as Grafana sends it (variables not substituted)."""
    return {f"{p['title']} / {t['refId']}": t["expr"]
            for p in dashboard_panels() for t in p["targets"]}


def variable_queries() -> dict[str, tuple[str, str]]:
    """Query variable name -> (metric, label) of its ``label_values(metric, label)``."""
    out = {}
    for var in dashboard()["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = _LABEL_VALUES.match(query.strip())
        assert m, f"variable {var['name']}: unsupported query {query!r}"
        out[var["name"]] = (m.group(1), m.group(2))
    return out


def all_exprs() -> dict[str, str]:
    """Source -> expr for every alert and dashboard query."""
    exprs = {f"alert {r['alert']}": str(r["expr"]) for r in alert_rules()}
    exprs.update({f"panel {k}": v for k, v in dashboard_exprs().items()})
    return exprs


def substitute_grafana_variables(expr: str, rate_interval: str = "1m") -> str:
    """The expression as Grafana would send it with every instance selected."""
    return expr.replace("$__rate_interval", rate_interval).replace("$instance", ".*")
