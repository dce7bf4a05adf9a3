"""``/metrics`` over HTTP: every contract metric is there from the start (graph metrics at
zero), and counters move with the calls that ought to move them."""

from __future__ import annotations

import grpc
import pytest

from service.gen.model_executor.v1 import executor_pb2 as pb
from tests.service.harness import ServerHarness

Key = tuple[str, tuple[tuple[str, str], ...]]

CONTRACT = [
    "model_executor_step_seconds_bucket", "model_executor_tokens_total",
    "model_executor_batch_size_bucket", "model_executor_eager_fallbacks_total",
    "model_executor_graph_replays_total", "model_executor_graph_replay_seconds_bucket",
    "model_executor_padded_tokens_total", "model_executor_graph_captured_buckets",
    "model_executor_graph_capture_seconds", "model_executor_graph_memory_bytes",
    "model_executor_graph_capture_failures_total", "model_executor_kv_tokens",
    "model_executor_kv_usage_ratio", "model_executor_kv_slots",
    "model_executor_active_sequences", "model_executor_kv_allocation_failures_total",
    "model_executor_healthy", "model_executor_build_info", "model_executor_model_info",
    "grpc_server_started_total", "grpc_server_handled_total",
    "grpc_server_handling_seconds_bucket",
]


def labels(**kv: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(kv.items()))


def value(metrics: dict[Key, float], name: str, **kv: str) -> float:
    return metrics.get((name, labels(**kv)), 0.0)


def handled(metrics: dict[Key, float], method: str, code: str) -> float:
    return value(metrics, "grpc_server_handled_total", grpc_service="model_executor.v1.Executor",
                 grpc_method=method, grpc_type="unary", grpc_code=code)


def test_contract_metrics_exist_and_graph_ones_start_at_zero(server: ServerHarness) -> None:
    metrics = server.scrape()
    names = {name for name, _ in metrics}
    assert not [n for n in CONTRACT if n not in names]
    for phase in ("prefill", "decode"):
        assert value(metrics, "model_executor_graph_replays_total", phase=phase) == 0
        assert value(metrics, "model_executor_graph_captured_buckets", phase=phase) == 0
        assert value(metrics, "model_executor_graph_capture_failures_total", phase=phase,
                     reason="oom") == 0
    assert value(metrics, "model_executor_healthy") == 1
    assert all(n.startswith(("model_executor_", "grpc_server_", "python_", "process_"))
               for n in names)
    for (name, label_set), _ in metrics.items():  # no unbounded label values
        assert not any(k in ("seq_id", "request_id") for k, _ in label_set), name


def test_counters_move_with_calls(server: ServerHarness) -> None:
    before = server.scrape()
    items = [pb.PrefillItem(seq_id="m1", token_ids=[1, 2, 3, 4], sample=True),
             pb.PrefillItem(seq_id="m2", token_ids=[5, 6], sample=True)]
    first = server.stub.Prefill(pb.PrefillRequest(items=items), timeout=10)
    server.stub.Decode(pb.DecodeRequest(items=[
        pb.DecodeItem(seq_id=o.seq_id, token_id=o.token_id) for o in first.outputs]), timeout=10)
    with pytest.raises(grpc.RpcError):
        server.stub.Decode(pb.DecodeRequest(items=[pb.DecodeItem(seq_id="nope")]), timeout=10)
    during = server.scrape()
    server.stub.Release(pb.ReleaseRequest(seq_ids=["m1", "m2"]), timeout=10)
    after = server.scrape()

    def delta(name: str, **kv: str) -> float:
        return value(after, name, **kv) - value(before, name, **kv)

    assert delta("model_executor_tokens_total", phase="prefill") == 6
    assert delta("model_executor_tokens_total", phase="decode") == 2
    assert delta("model_executor_step_seconds_count", phase="prefill", path="eager") == 1
    assert delta("model_executor_batch_size_sum", phase="decode") == 2
    assert delta("model_executor_eager_fallbacks_total", phase="decode", reason="no_cuda") == 1
    assert handled(after, "Prefill", "OK") - handled(before, "Prefill", "OK") == 1
    assert handled(after, "Decode", "NOT_FOUND") - handled(before, "Decode", "NOT_FOUND") == 1
    assert handled(after, "Release", "OK") - handled(before, "Release", "OK") == 1
    assert delta("grpc_server_handling_seconds_count", grpc_service="model_executor.v1.Executor",
                 grpc_method="Decode", grpc_type="unary") == 2
    # KV gauges follow the executor's accounting after each call
    kv = server.kv()
    assert value(during, "model_executor_kv_tokens", state="used") == \
        value(before, "model_executor_kv_tokens", state="used") + 8
    assert value(during, "model_executor_active_sequences") == kv.active_sequences + 2
    assert value(after, "model_executor_kv_tokens", state="free") == kv.free_tokens
    assert value(after, "model_executor_kv_usage_ratio") == pytest.approx(
        (kv.total_tokens - kv.free_tokens) / kv.total_tokens)
