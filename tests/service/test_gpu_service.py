"""The service on CUDA: start-up capture, graph replays through Prefill/Decode, the graph
metrics, and the Capture RPC. Runs on a GPU machine only (marker ``gpu``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from executor.config import CacheConfig, ExecutorConfig, GraphConfig, ModelConfig
from service.gen.model_executor.v1 import executor_pb2 as pb
from tests.service.harness import ServerHarness

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_server() -> Iterator[ServerHarness]:
    config = ExecutorConfig(
        model=ModelConfig(source="tiny"), device="cuda",
        cache=CacheConfig(kv_tokens=8192, max_sequences=16, max_context=1024),
        graphs=GraphConfig(decode_mode="full", prefill_mode="breakable"),
        max_prefill_tokens=256, max_decode_batch=16)
    harness = ServerHarness(config)
    try:
        harness.wait_ready(timeout=300)
        yield harness
    finally:
        harness.close()


def metric(harness: ServerHarness, name: str, **labels: str) -> float:
    return harness.scrape().get((name, tuple(sorted(labels.items()))), 0.0)


def test_startup_capture_is_reported(gpu_server: ServerHarness) -> None:
    health = gpu_server.stub.Health(pb.HealthRequest(), timeout=5)
    assert health.state == pb.SERVER_STATE_READY and health.model.device.startswith("cuda")
    graphs = {g.phase: g for g in health.graphs}
    assert graphs[pb.PHASE_DECODE].mode == "full"
    assert 1 in graphs[pb.PHASE_DECODE].captured_sizes
    assert graphs[pb.PHASE_PREFILL].captured_sizes
    for phase, status in (("decode", graphs[pb.PHASE_DECODE]),
                          ("prefill", graphs[pb.PHASE_PREFILL])):
        assert metric(gpu_server, "model_executor_graph_captured_buckets", phase=phase) == \
            len(status.captured_sizes)
        assert metric(gpu_server, "model_executor_graph_capture_seconds", phase=phase) > 0


def test_steps_replay_graphs_and_count_them(gpu_server: ServerHarness) -> None:
    stub = gpu_server.stub
    before = metric(gpu_server, "model_executor_graph_replays_total", phase="decode")
    seqs = [f"g{i}" for i in range(3)]
    first = stub.Prefill(pb.PrefillRequest(items=[
        pb.PrefillItem(seq_id=s, token_ids=[3 + i, 4, 5, 6], sample=True)
        for i, s in enumerate(seqs)]), timeout=30)
    tokens = {o.seq_id: o.token_id for o in first.outputs}
    try:
        for _ in range(5):
            step = stub.Decode(pb.DecodeRequest(items=[
                pb.DecodeItem(seq_id=s, token_id=tokens[s]) for s in seqs]), timeout=30)
            assert step.step.path == pb.PATH_GRAPH, step.step.fallback_reason
            assert step.step.padded_tokens == 1  # 3 sequences run in the bucket of 4
            tokens = {o.seq_id: o.token_id for o in step.outputs}
    finally:
        stub.Release(pb.ReleaseRequest(seq_ids=seqs), timeout=10)
    assert metric(gpu_server, "model_executor_graph_replays_total", phase="decode") == \
        before + 5
    assert metric(gpu_server, "model_executor_padded_tokens_total", phase="decode") >= 5
    assert metric(gpu_server, "model_executor_graph_replay_seconds_count", phase="decode") > 0


def test_capture_rpc_recaptures(gpu_server: ServerHarness) -> None:
    captured = metric(gpu_server, "model_executor_graph_captured_buckets", phase="decode")
    assert captured > 0
    again = gpu_server.stub.Capture(pb.CaptureRequest(phases=[pb.PHASE_DECODE]), timeout=300)
    assert not again.phases[0].buckets  # nothing missing, nothing captured
    response = gpu_server.stub.Capture(
        pb.CaptureRequest(phases=[pb.PHASE_DECODE], force=True), timeout=300)
    [phase] = response.phases
    assert phase.phase == pb.PHASE_DECODE and phase.backend == "full"
    assert len(phase.buckets) == captured and all(b.ok for b in phase.buckets)
    assert 1 in {b.size for b in phase.buckets} and phase.total_ms > 0
    assert metric(gpu_server, "model_executor_graph_captured_buckets", phase="decode") == \
        captured
    assert metric(gpu_server, "model_executor_graph_memory_bytes", phase="decode") == \
        phase.memory_bytes
