"""Gemma 3 text (sliding and global layers, head_dim 256, q/k norms, a local RoPE base) at
``--tensor-parallel-size 2`` on two GPUs (marker ``gpu``; skips with fewer) against
``--tensor-parallel-size 1``, both replaying decode full graphs and breakable prefill
graphs (bf16, Triton attention with the window).

Both servers get the same calls, lockstep, and decode the TP = 1 server's tokens: wherever
the TP = 1 top-2 log-probability margin exceeds 0.05 the tokens must be equal, and every
sampled token's log-probability within 0.1 (all-reduce order changes bf16 rounding)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from bench.e2e.tensor_parallel import serve, stop
from service.gen.model_executor.v1 import executor_pb2 as pb
from service.gen.model_executor.v1 import executor_pb2_grpc as pb_grpc
from tests.helpers.models import GPU_WINDOW, write_gpu_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 GPUs (tensor parallelism)")]

SCORED = pb.SamplingParams(logprobs=True, top_logprobs=2)
MARGIN, LOGPROB_ATOL = 0.05, 0.1


@pytest.fixture(scope="module", params=["gemma3", "gemma2"])
def servers(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[pb_grpc.ExecutorStub, pb_grpc.ExecutorStub]]:
    model: Path = write_gpu_model(tmp_path_factory.mktemp("tp"), request.param, seed=9)
    procs: list[subprocess.Popen[bytes]] = []
    stubs = []
    try:
        for tp in (1, 2):
            proc, target, _ = serve(model, tp)
            procs.append(proc)
            stubs.append(pb_grpc.ExecutorStub(grpc.insecure_channel(target)))
        yield stubs[0], stubs[1]
    finally:
        for proc in procs:
            stop(proc)


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_gemma_tp2_equals_tp1_under_graphs(servers: tuple[pb_grpc.ExecutorStub,
                                                          pb_grpc.ExecutorStub]) -> None:
    ref, tp2 = servers
    for stub in (ref, tp2):
        model = stub.Health(pb.HealthRequest(), timeout=30).model
        assert model.sliding_window == GPU_WINDOW and "gemma_norms" in model.model_features
    prompts = {"a": _tokens(1, 300), "b": _tokens(2, 45), "c": _tokens(3, 200)}
    agree = total = 0

    def both(method: str, request: object) -> tuple[object, object]:
        return (getattr(ref, method)(request, timeout=120),
                getattr(tp2, method)(request, timeout=120))

    def take(r: object, g: object, last: dict[str, int]) -> None:
        nonlocal agree, total
        for ro, go in zip(r.outputs, g.outputs, strict=True):  # type: ignore[attr-defined]
            (_, lp1), (_, lp2) = [(t.token_id, t.logprob) for t in ro.top_logprobs]
            if lp1 - lp2 > MARGIN:
                assert go.token_id == ro.token_id, (ro, go)
            assert go.logprob == pytest.approx(ro.logprob, abs=LOGPROB_ATOL)
            agree += go.token_id == ro.token_id
            total += 1
            last[ro.seq_id] = ro.token_id

    both("Prefill", pb.PrefillRequest(items=[
        pb.PrefillItem(seq_id=s, token_ids=p[: len(p) // 2]) for s, p in prompts.items()]))
    r, g = both("Prefill", pb.PrefillRequest(items=[
        pb.PrefillItem(seq_id=s, token_ids=p[len(p) // 2:], sample=True, sampling=SCORED)
        for s, p in prompts.items()]))
    assert r.step.path == g.step.path == pb.PATH_GRAPH  # type: ignore[attr-defined]
    last: dict[str, int] = {}
    take(r, g, last)
    for _ in range(16):
        r, g = both("Decode", pb.DecodeRequest(items=[
            pb.DecodeItem(seq_id=s, token_id=t, sampling=SCORED) for s, t in last.items()]))
        assert r.step.path == g.step.path == pb.PATH_GRAPH  # type: ignore[attr-defined]
        take(r, g, last)
    assert agree >= total - 2, f"{agree} of {total} tokens agree"
    both("Release", pb.ReleaseRequest(seq_ids=list(prompts)))
