"""Weights that change under a served CUDA executor (marker ``gpu``): full decode graphs
and breakable prefill stay captured through an update (no recapture), and the tokens after
it equal those of a fresh server on the new weights, bit for bit; Sleep(weights, kv_cache)
gives the memory back to the device (``torch.cuda.mem_get_info``) and WakeUp, which
recaptures, restores the same tokens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from executor.config import CacheConfig, ExecutorConfig, GraphConfig, ModelConfig
from executor.graphs.graph_runner import GraphRunner
from executor.weights.random_weights import write_random_model
from service.gen.model_executor.v1 import executor_pb2 as pb
from tests.service.harness import ServerHarness

pytestmark = pytest.mark.gpu
PROMPTS = [[3, 5, 7, 11, 13], [(i * 37) % 1000 + 3 for i in range(40)], [42, 1, 2]]
STEPS = 16


def _cfg() -> Any:
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024,
                         num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-5)
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpu-weights")
    return {name: write_random_model(root / name, _cfg(), seed=seed, dtype=torch.bfloat16)
            for name, seed in (("w1", 1), ("w2", 2))}


def serve(path: Path) -> ServerHarness:
    config = ExecutorConfig(
        model=ModelConfig(source=str(path), dtype="bfloat16"), device="cuda",
        cache=CacheConfig(kv_tokens=16384, max_sequences=8, max_context=1024),
        graphs=GraphConfig(decode_mode="full", prefill_mode="breakable",
                           decode_buckets=(1, 2, 4, 8), prefill_buckets=(16, 64, 128)),
        max_prefill_tokens=128, max_decode_batch=8)
    harness = ServerHarness(config)
    harness.wait_ready(timeout=300)
    return harness


def greedy(server: ServerHarness, tag: str) -> tuple[list[list[int]], set[int]]:
    """Tokens of every prompt (decoded together), and the paths the decodes took."""
    stub = server.stub
    ids = [f"{tag}-{i}" for i in range(len(PROMPTS))]
    out = stub.Prefill(pb.PrefillRequest(items=[
        pb.PrefillItem(seq_id=s, token_ids=p, sample=True)
        for s, p in zip(ids, PROMPTS, strict=True)]), timeout=60)
    tokens = [[o.token_id] for o in out.outputs]
    paths = set()
    for _ in range(STEPS - 1):
        step = stub.Decode(pb.DecodeRequest(items=[
            pb.DecodeItem(seq_id=s, use_last_sampled=True) for s in ids]), timeout=60)
        paths.add(step.step.path)
        for row, o in zip(tokens, step.outputs, strict=True):
            row.append(o.token_id)
    stub.Release(pb.ReleaseRequest(seq_ids=ids), timeout=30)
    return tokens, paths


@pytest.fixture(scope="module")
def fresh_w2(dirs: dict[str, Path]) -> list[list[int]]:
    server = serve(dirs["w2"])
    try:
        return greedy(server, "fresh")[0]
    finally:
        server.close()


@pytest.fixture(scope="module")
def server(dirs: dict[str, Path], fresh_w2: list[list[int]]) -> Iterator[ServerHarness]:
    harness = serve(dirs["w1"])
    try:
        yield harness
    finally:
        harness.close()


def test_an_update_keeps_the_graphs_and_equals_a_fresh_server(
        server: ServerHarness, dirs: dict[str, Path], fresh_w2: list[list[int]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    captures: list[str] = []
    capture_all = GraphRunner.capture_all

    def counted(self: GraphRunner, *args: Any, **kwargs: Any) -> Any:
        captures.append(self.phase)
        return capture_all(self, *args, **kwargs)

    monkeypatch.setattr(GraphRunner, "capture_all", counted)
    before_graphs = server.stub.Health(pb.HealthRequest(), timeout=5).graphs
    w1, _ = greedy(server, "w1")
    assert w1 != fresh_w2
    done = server.stub.UpdateWeights(pb.UpdateWeightsRequest(
        weight_version="w2", path=str(dirs["w2"])), timeout=120)
    assert done.tensors_updated > 0
    tokens, paths = greedy(server, "w2")
    assert tokens == fresh_w2 and paths == {pb.PATH_GRAPH}
    assert captures == []  # nothing recaptured
    assert server.stub.Health(pb.HealthRequest(), timeout=5).graphs == before_graphs


def test_sleep_frees_the_device_and_wake_up_restores_the_tokens(
        server: ServerHarness, dirs: dict[str, Path]) -> None:
    server.stub.UpdateWeights(pb.UpdateWeightsRequest(weight_version="w2",
                                                      path=str(dirs["w2"])), timeout=120)
    before, _ = greedy(server, "pre")
    torch.cuda.synchronize()
    free_awake, _ = torch.cuda.mem_get_info()
    slept = server.stub.Sleep(pb.SleepRequest(tags=["weights", "kv_cache"]), timeout=120)
    free_asleep, _ = torch.cuda.mem_get_info()
    assert slept.freed_bytes > 0
    # what the executor held (weights, KV, graphs) went back to the device
    assert free_asleep - free_awake >= 0.9 * slept.freed_bytes
    woke = server.stub.WakeUp(pb.WakeUpRequest(), timeout=300)
    assert woke.recapture_ms > 0 and not woke.sleeping
    tokens, paths = greedy(server, "post")
    assert tokens == before and paths == {pb.PATH_GRAPH}
