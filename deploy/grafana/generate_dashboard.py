"""Generate deploy/grafana/dashboards/model-executor.json (Grafana 10/11, schema 39).

The dashboard is data: the table ``ROWS`` below lists every panel with its queries;
this script lays them out on Grafana's 24-column grid and writes the JSON. Edit the table,
then regenerate; tests/system/deploy fails when the committed JSON is stale, when a query names a
metric the live service does not export, or when promtool rejects a query.

    .venv/bin/python deploy/grafana/generate_dashboard.py           # rewrite the JSON
    .venv/bin/python deploy/grafana/generate_dashboard.py --check   # exit 1 if stale

Every selector filters on the ``instance`` variable; every panel reads the datasource
variable ``DS_PROMETHEUS``, so the file imports into any Grafana with no edits.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OUTPUT = Path(__file__).resolve().parent / "dashboards" / "model-executor.json"
UID = "model-executor"
DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
SEL = 'instance=~"$instance"'  # every selector carries it
RATE = "$__rate_interval"
EXECUTOR_RPCS = f'{SEL}, grpc_service="model_executor.v1.Executor"'


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""
    instant: bool = False  # table panels read one value per series
    heatmap: bool = False  # the histogram's buckets, one series per `le`


@dataclass(frozen=True)
class Panel:
    title: str
    kind: str  # timeseries | stat | gauge | table | heatmap
    queries: tuple[Query, ...]
    description: str
    unit: str = "short"
    width: int = 12
    height: int = 8
    stack: bool = False
    thresholds: tuple[tuple[str, float | None], ...] = (("green", None),)
    mappings: tuple[dict[str, Any], ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)


def quantiles(metric: str, by: str, legend: str) -> tuple[Query, ...]:
    """p50 and p99 of a histogram, aggregated across the selected instances."""
    return tuple(
        Query(f"histogram_quantile({q}, sum by (le, {by}) "
              f"(rate({metric}_bucket{{{SEL}}}[{RATE}])))", f"p{int(q * 100)} {legend}")
        for q in (0.5, 0.99))


HEALTH_MAPPINGS = ({"type": "value", "options": {
    "0": {"text": "NOT READY", "color": "red", "index": 0},
    "1": {"text": "READY", "color": "green", "index": 1}}},)

# A target that stops answering scrapes loses its model_executor_healthy series (stale),
# so the panel would drop it; `up` stays, at 0: count it as not ready.
READY = (f"max by (instance) (model_executor_healthy{{{SEL}}}) or on (instance) "
         f'max by (instance) (up{{job="model-executor", {SEL}}} * 0)')

STEPS_PER_SECOND = (f"sum by (phase) (rate(model_executor_graph_replays_total{{{SEL}}}[{RATE}]))"
                    f" + sum by (phase) (rate(model_executor_eager_fallbacks_total{{{SEL}}}"
                    f"[{RATE}]))")

ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    ("Overview", (
        Panel("Ready", "stat", (Query(READY, "{{instance}}"),),
              "Readiness per instance: 1 once weights are loaded, the KV cache allocated and "
              "start-up capture done; 0 while starting, capturing, draining or after a fatal "
              "device error, and for an instance Prometheus cannot scrape (down, crashed): "
              "it shows NOT READY instead of vanishing.", width=4, height=5,
              mappings=HEALTH_MAPPINGS, thresholds=(("red", None), ("green", 1))),
        Panel("Tokens / s", "stat", (Query(
            f"sum(rate(model_executor_tokens_total{{{SEL}}}[{RATE}]))", "tokens/s"),),
            "Tokens run through the model (prefill + decode, without padding).",
            unit="short", width=4, height=5),
        Panel("KV cache used", "gauge", (Query(
            f"max(model_executor_kv_usage_ratio{{{SEL}}})", "max"),),
            "The fullest selected instance's KV usage (used / total token locations). "
            "Alert at 90%.", unit="percentunit", width=4, height=5,
            thresholds=(("green", None), ("orange", 0.75), ("red", 0.9)),
            extra={"min": 0, "max": 1}),
        Panel("Active sequences", "stat", (Query(
            f"sum(model_executor_active_sequences{{{SEL}}})", "sequences"),),
            "Sequences admitted and not yet released, over the selected instances.",
            width=4, height=5),
        Panel("Eager fallback ratio", "stat", (Query(
            f"sum(rate(model_executor_eager_fallbacks_total{{{SEL}}}[{RATE}])) / "
            f"(sum(rate(model_executor_eager_fallbacks_total{{{SEL}}}[{RATE}])) + "
            f"sum(rate(model_executor_graph_replays_total{{{SEL}}}[{RATE}])))", "eager"),),
            "Share of steps that ran eagerly instead of replaying a CUDA graph (all reasons, "
            "including graphs_disabled and no_cuda).", unit="percentunit", width=4, height=5,
            thresholds=(("green", None), ("orange", 0.1), ("red", 0.2))),
        Panel("Model", "table", (Query(f"max by (instance, name, architecture, dtype, device) "
                                       f"(model_executor_model_info{{{SEL}}})", instant=True),),
              "The served model per instance.", width=4, height=5,
              extra={"transformations": [{"id": "organize", "options": {
                  "excludeByName": {"Time": True, "Value": True}}}]}),
    )),
    ("Latency", (
        Panel("Step latency by phase and path (p50, p99)", "timeseries",
              quantiles("model_executor_step_seconds", "phase, path", "{{phase}} {{path}}"),
              "Wall time of one executor step (validation, forward, sampling), split by "
              "phase (prefill, decode) and path (graph replay, eager).", unit="s"),
        Panel("Graph replay latency (p50, p99)", "timeseries",
              quantiles("model_executor_graph_replay_seconds", "phase", "{{phase}}"),
              "Forward time of steps replayed from a CUDA graph (measured with CUDA events).",
              unit="s"),
        Panel("Graph replay latency distribution", "heatmap", (Query(
            f"sum by (le) (increase(model_executor_graph_replay_seconds_bucket{{{SEL}}}"
            f"[{RATE}]))", "{{le}}", heatmap=True),),
            "Replays per latency bucket over time, both phases.", unit="s", width=24,
            extra={"options": {"calculate": False, "yAxis": {"unit": "s"},
                               "cellGap": 1, "color": {"mode": "scheme",
                                                       "scheme": "Oranges"}}}),
    )),
    ("CUDA graphs", (
        Panel("Steps: graph replays vs eager", "timeseries", (
            Query(f"sum by (phase) (rate(model_executor_graph_replays_total{{{SEL}}}[{RATE}]))",
                  "graph {{phase}}"),
            Query(f"sum by (phase) (rate(model_executor_eager_fallbacks_total{{{SEL}}}"
                  f"[{RATE}]))", "eager {{phase}}")),
            "Steps per second by how they ran.", unit="ops", stack=True),
        Panel("Eager fallbacks by reason", "timeseries", (Query(
            f"sum by (phase, reason) (rate(model_executor_eager_fallbacks_total{{{SEL}}}"
            f"[{RATE}])) > 0", "{{phase}} {{reason}}"),),
            "Why steps ran eagerly: no_cuda, graphs_disabled, exceeds_largest_bucket, "
            "bucket_not_captured, capture_failed, padding_too_large.", unit="ops",
            stack=True),
        Panel("Captured graphs per phase", "table", (
            Query(f"max by (instance, phase) (model_executor_graph_captured_buckets{{{SEL}}})",
                  instant=True),
            Query(f"max by (instance, phase) (model_executor_graph_capture_seconds{{{SEL}}})",
                  instant=True),
            Query(f"max by (instance, phase) (model_executor_graph_memory_bytes{{{SEL}}})",
                  instant=True),
            Query(f"sum by (instance, phase) "
                  f"(model_executor_graph_capture_failures_total{{{SEL}}})", instant=True)),
            "Per instance and phase: buckets captured now, duration of the last capture, "
            "device memory held by the graphs, and buckets whose capture failed.",
            extra={"transformations": [
                {"id": "merge", "options": {}},
                {"id": "organize", "options": {
                    "excludeByName": {"Time": True},
                    "renameByName": {"Value #A": "buckets", "Value #B": "capture time",
                                     "Value #C": "graph memory",
                                     "Value #D": "capture failures"}}}],
                "fieldConfig": {"defaults": {}, "overrides": [
                    {"matcher": {"id": "byName", "options": "capture time"},
                     "properties": [{"id": "unit", "value": "s"}]},
                    {"matcher": {"id": "byName", "options": "graph memory"},
                     "properties": [{"id": "unit", "value": "bytes"}]}]}}),
        Panel("Padded tokens / s", "timeseries", (Query(
            f"sum by (phase) (rate(model_executor_padded_tokens_total{{{SEL}}}[{RATE}]))",
            "{{phase}}"),),
            "Padding added to reach a captured bucket: wasted work.", unit="short"),
    )),
    ("KV cache and sequences", (
        Panel("KV usage", "timeseries", (Query(
            f"model_executor_kv_usage_ratio{{{SEL}}}", "{{instance}}"),),
            "Used / total KV token locations per instance. Alert above 90% for 5 minutes.",
            unit="percentunit", thresholds=(("green", None), ("red", 0.9)),
            extra={"min": 0, "max": 1, "thresholdsStyle": "line"}),
        Panel("Active sequences and free slots", "timeseries", (
            Query(f"model_executor_active_sequences{{{SEL}}}", "active {{instance}}"),
            Query(f'model_executor_kv_slots{{{SEL}, state="free"}}', "free slots {{instance}}"),
            Query(f"model_executor_forked_sequences{{{SEL}}}", "forked {{instance}}")),
            "Sequences admitted and not released (forked: created by Fork), and sequence "
            "slots still free."),
        Panel("KV token locations", "timeseries", (Query(
            f"sum by (state) (model_executor_kv_tokens{{{SEL}}})", "{{state}}"),),
            "KV token locations used and free, over the selected instances.", stack=True),
        Panel("Shared KV token locations", "timeseries", (Query(
            f"model_executor_kv_shared_tokens{{{SEL}}}", "shared {{instance}}"),),
            "Used locations held by more than one sequence (Fork shares a prefix); each "
            "counts once among the used ones."),
        Panel("Refused for lack of KV", "timeseries", (Query(
            f"sum by (resource) (rate(model_executor_kv_allocation_failures_total{{{SEL}}}"
            f"[{RATE}]))", "{{resource}}"),),
            "Calls answered RESOURCE_EXHAUSTED because KV tokens or sequence slots ran out.",
            unit="reqps"),
    )),
    ("Throughput", (
        Panel("Tokens / s by phase", "timeseries", (Query(
            f"sum by (phase) (rate(model_executor_tokens_total{{{SEL}}}[{RATE}]))",
            "{{phase}}"),),
            "Tokens run through the model, prefill (prompt) and decode (generated)."),
        Panel("Batch size by phase (mean, p99)", "timeseries", (
            Query(f"sum by (phase) (rate(model_executor_batch_size_sum{{{SEL}}}[{RATE}])) / "
                  f"sum by (phase) (rate(model_executor_batch_size_count{{{SEL}}}[{RATE}]))",
                  "mean {{phase}}"),
            Query(f"ceil(histogram_quantile(0.99, sum by (le, phase) "
                  f"(rate(model_executor_batch_size_bucket{{{SEL}}}[{RATE}]))))",
                  "p99 {{phase}}")),
            "Sequences per step. The mean is exact. Batch sizes are whole numbers, but a "
            "quantile interpolates inside a bucket (all batches of 1 would read 0.5 at p50, "
            "the first bucket being (0, 1]), so p99 is rounded up to a whole batch."),
    )),
    ("gRPC", (
        Panel("RPC rate by method", "timeseries", (Query(
            f"sum by (grpc_method) (rate(grpc_server_handled_total{{{EXECUTOR_RPCS}}}"
            f"[{RATE}]))", "{{grpc_method}}"),),
            "model_executor.v1.Executor calls completed per second.", unit="reqps",
            width=8),
        Panel("RPC errors by code", "timeseries", (Query(
            f"sum by (grpc_method, grpc_code) (rate(grpc_server_handled_total"
            f'{{{EXECUTOR_RPCS}, grpc_code!="OK"}}[{RATE}]))', "{{grpc_method}} {{grpc_code}}"),),
            "Executor calls that did not end OK, by method and status code.", unit="reqps",
            width=8, stack=True),
        Panel("Executor queue and calls in flight", "timeseries", (
            Query(f"sum(model_executor_executor_queue_depth{{{SEL}}})", "executor queue"),
            Query(f"sum by (kind) (model_executor_calls_in_flight{{{SEL}}})",
                  "in flight: {{kind}}")),
            "Executor calls queued or running (above 1, calls wait for the executor thread) "
            "and gRPC calls in flight by admission kind (probe, watch, call).", width=8),
        Panel("Executor queue wait (p50, p99)", "timeseries",
              quantiles("model_executor_executor_queue_wait_seconds", "instance",
                        "{{instance}}"),
              "How long a call waited for the executor thread before it started.",
              unit="s", width=8),
        Panel("Refused as overloaded", "timeseries", (Query(
            f"sum by (kind) (rate(model_executor_overload_refusals_total{{{SEL}}}"
            f"[{RATE}]))", "{{kind}}"),),
            "Calls answered RESOURCE_EXHAUSTED (reason OVERLOADED or "
            "WATCH_STREAMS_EXHAUSTED) because their kind's in-flight budget was full: "
            "--max-concurrent-rpcs, --max-watch-streams. Not KV exhaustion.", unit="reqps",
            width=8),
        Panel("RPC latency by method (p99)", "timeseries", (Query(
            f"histogram_quantile(0.99, sum by (le, grpc_method) (rate("
            f"grpc_server_handling_seconds_bucket{{{EXECUTOR_RPCS}}}[{RATE}])))",
            "{{grpc_method}}"),),
            "Server-side latency of Executor calls, from the interceptor.", unit="s", width=8),
    )),
    ("Tensor parallelism", (
        Panel("Other ranks: step delivery and launch lag (p50, p99)", "timeseries",
              quantiles("model_executor_tp_launch_lag_seconds", "phase", "lag {{phase}}")
              + quantiles("model_executor_tp_step_delivery_seconds", "phase",
                          "delivery {{phase}}"),
              "Servers split over several GPUs of one host (--tensor-parallel-size): per "
              "call, from rank 0 starting to send a step to the last other rank having it "
              "(delivery), and how much later than rank 0 that rank launched the step's "
              "forward (launch lag: rank 0's GPU waits that long at the step's first "
              "collective; 0 when every rank launched first). Empty for one-process servers.",
              unit="s"),
        Panel("Tensor-parallel servers", "table", (
            Query(f"max by (instance) (model_executor_tensor_parallel_size{{{SEL}}}) > 1",
                  instant=True),
            Query(f"max by (instance, algorithm) (model_executor_tp_all_reduce{{{SEL}}})",
                  instant=True)),
            "Per tensor-parallel instance: its ranks and what its small all-reduces run as "
            "(--tp-all-reduce, auto's choice included: push, flags, symm_mem, or several "
            "joined by +; nccl; gloo on CPU).",
            extra={"transformations": [
                {"id": "merge", "options": {}},
                {"id": "organize", "options": {
                    "excludeByName": {"Time": True, "Value #B": True},
                    "renameByName": {"Value #A": "ranks",
                                     "algorithm": "small all-reduces"}}}]}),
    )),
)


def _field_config(p: Panel) -> dict[str, Any]:
    defaults: dict[str, Any] = {
        "unit": p.unit,
        "thresholds": {"mode": "absolute", "steps": [
            {"color": color, "value": value} for color, value in p.thresholds]},
        "mappings": list(p.mappings),
    }
    for key in ("min", "max"):
        if key in p.extra:
            defaults[key] = p.extra[key]
    if p.kind == "timeseries":
        defaults["custom"] = {
            "drawStyle": "line", "lineWidth": 1, "fillOpacity": 20 if p.stack else 5,
            "showPoints": "never", "spanNulls": False,
            "stacking": {"mode": "normal" if p.stack else "none", "group": "A"},
            "thresholdsStyle": {"mode": p.extra.get("thresholdsStyle", "off")},
        }
    overrides = p.extra.get("fieldConfig", {}).get("overrides", [])
    return {"defaults": defaults, "overrides": overrides}


def _options(p: Panel) -> dict[str, Any]:
    if p.kind == "timeseries":
        return {"legend": {"displayMode": "table", "placement": "bottom",
                           "calcs": ["mean", "max", "lastNotNull"]},
                "tooltip": {"mode": "multi", "sort": "desc"}}
    if p.kind in ("stat", "gauge"):
        return {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                "colorMode": "value", "graphMode": "area", "textMode": "auto",
                "orientation": "auto", "showThresholdMarkers": True}
    if p.kind == "table":
        return {"showHeader": True, "cellHeight": "sm"}
    return dict(p.extra.get("options", {}))


def _targets(p: Panel) -> list[dict[str, Any]]:
    targets = []
    for i, q in enumerate(p.queries):
        t: dict[str, Any] = {"datasource": DS, "refId": chr(ord("A") + i), "expr": q.expr,
                             "legendFormat": q.legend, "range": not q.instant,
                             "instant": q.instant}
        if q.instant:
            t["format"] = "table"
        elif q.heatmap:
            t["format"] = "heatmap"
        targets.append(t)
    return targets


def _variables() -> list[dict[str, Any]]:
    instance_query = "label_values(model_executor_build_info, instance)"
    return [
        {"name": "DS_PROMETHEUS", "label": "Data source", "type": "datasource",
         "query": "prometheus", "current": {}, "hide": 0, "refresh": 1, "regex": "",
         "options": [], "includeAll": False, "multi": False},
        {"name": "instance", "label": "Instance", "type": "query", "datasource": DS,
         "definition": instance_query,
         "query": {"query": instance_query, "refId": "PrometheusVariableQueryEditor"},
         "refresh": 2, "sort": 1, "multi": True, "includeAll": True, "allValue": ".*",
         "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
         "hide": 0, "regex": "", "options": []},
    ]


def build() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    next_id, y = 1, 0
    for row_title, row_panels in ROWS:
        panels.append({"type": "row", "title": row_title, "id": next_id, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        next_id, y, x, row_height = next_id + 1, y + 1, 0, 0
        for p in row_panels:
            if x + p.width > 24:
                x, y, row_height = 0, y + row_height, 0
            panel: dict[str, Any] = {
                "type": p.kind, "title": p.title, "description": p.description,
                "id": next_id, "datasource": DS,
                "gridPos": {"h": p.height, "w": p.width, "x": x, "y": y},
                "targets": _targets(p), "fieldConfig": _field_config(p),
                "options": _options(p),
            }
            if "transformations" in p.extra:
                panel["transformations"] = p.extra["transformations"]
            panels.append(panel)
            next_id, x, row_height = next_id + 1, x + p.width, max(row_height, p.height)
        y += row_height
    return {
        "uid": UID, "title": "model-executor",
        "description": "gRPC LLM executor: step latency, CUDA graphs, KV cache, gRPC.",
        "tags": ["model-executor", "llm", "cuda-graphs"],
        "schemaVersion": 39, "version": 1, "editable": True, "graphTooltip": 1,
        "refresh": "10s", "time": {"from": "now-1h", "to": "now"}, "timepicker": {},
        "timezone": "", "links": [], "liveNow": False, "fiscalYearStartMonth": 0,
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts", "type": "dashboard"}]},
        "templating": {"list": _variables()},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Generate the Grafana dashboard JSON.")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if the committed JSON differs from the generated one")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUTPUT.is_file() or OUTPUT.read_text() != text:
            print(f"{OUTPUT} is stale: run {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
