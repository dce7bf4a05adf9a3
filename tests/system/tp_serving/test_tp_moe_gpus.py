"""A mixture-of-experts model under tensor parallelism on two GPUs (marker ``gpu``; skips
with fewer): ``serve --tensor-parallel-size 2`` of a bf16 random Qwen3-MoE (16 experts,
top 4, one dense layer; each rank holds half of every expert's width), and of its FP8
per-channel checkpoint (the experts in e4m3 too), against ``--tensor-parallel-size 1``,
both replaying graphs (breakable prefill, full decode) with the experts' all-reduce
captured inside. Lockstep calls; wherever TP = 1's top-2 log-probability margin exceeds
0.05 (0.19 for FP8: ``FP8_MARGIN``) the tokens must be equal; the sampled tokens'
log-probabilities within 0.1 at 95 % of the positions and within 0.5 at all. (Unlike a
dense model's, a position may move by more than reduction noise: where a router's k-th
and (k+1)-th experts nearly tie, TP = 2's different bf16 sums can pick the other one, and
that position's distribution moves by the two experts' difference.)"""

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
from tests.helpers.fp8_models import write_fp8_copy
from tests.helpers.moe_models import gpu_moe_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 GPUs (tensor parallelism)")]

SCORED = pb.SamplingParams(logprobs=True, top_logprobs=2)
MARGIN, LOGPROB_ATOL, LOGPROB_MAX, WITHIN_SHARE = 0.05, 0.1, 0.5, 0.95
#: FP8 (as tests/system/tp_serving/test_tp_fp8_gpus.py): three bf16 steps of these
#: logits; each rank's per-token activation scales (prefill's FP8 GEMMs) cover its own half
#: of a row-parallel input, so ties within a step or two may flip.
FP8_MARGIN = 0.19


@pytest.fixture(scope="module", params=["bf16", "fp8-channel"])
def servers(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[pb_grpc.ExecutorStub, pb_grpc.ExecutorStub, float]]:
    """(TP = 1, TP = 2, the margin above which their tokens must be equal)."""
    root = tmp_path_factory.mktemp("tp-moe")
    model: Path = gpu_moe_model(root, "qwen3_moe")
    if request.param == "fp8-channel":  # FP8 experts: each rank's rows of their scales
        model = write_fp8_copy(model, root / "fp8", "channel")
    procs: list[subprocess.Popen[bytes]] = []
    stubs = []
    try:
        for tp in (1, 2):
            proc, target, _ = serve(model, tp)
            procs.append(proc)
            stubs.append(pb_grpc.ExecutorStub(grpc.insecure_channel(target)))
        yield stubs[0], stubs[1], MARGIN if request.param == "bf16" else FP8_MARGIN
    finally:
        for proc in procs:
            stop(proc)


def test_moe_tp2_equals_tp1_under_graphs(servers: tuple[pb_grpc.ExecutorStub,
                                                        pb_grpc.ExecutorStub, float]) -> None:
    ref, tp2, margin = servers
    health = tp2.Health(pb.HealthRequest(), timeout=30).model
    assert (health.tensor_parallel_size, health.num_experts,
            health.num_experts_per_token) == (2, 16, 4)
    gen = torch.Generator().manual_seed(0)
    prompts = {s: torch.randint(3, 1024, (n,), generator=gen).tolist()
               for s, n in (("a", 300), ("b", 45), ("c", 700))}
    agree = total = 0
    last: dict[str, int] = {}
    diffs: list[float] = []

    def both(method: str, request: object) -> tuple[object, object]:
        return (getattr(ref, method)(request, timeout=120),
                getattr(tp2, method)(request, timeout=120))

    def check(r: object, g: object) -> None:
        nonlocal agree, total
        assert r.step.path == g.step.path == pb.PATH_GRAPH  # type: ignore[attr-defined]
        for ro, go in zip(r.outputs, g.outputs, strict=True):  # type: ignore[attr-defined]
            (_, lp1), (_, lp2) = [(t.token_id, t.logprob) for t in ro.top_logprobs]
            if lp1 - lp2 > margin:
                assert go.token_id == ro.token_id, (ro, go)
            diffs.append(abs(go.logprob - ro.logprob))
            agree += go.token_id == ro.token_id
            total += 1
            last[ro.seq_id] = ro.token_id

    both("Prefill", pb.PrefillRequest(items=[
        pb.PrefillItem(seq_id=s, token_ids=p[: len(p) // 2]) for s, p in prompts.items()]))
    check(*both("Prefill", pb.PrefillRequest(items=[
        pb.PrefillItem(seq_id=s, token_ids=p[len(p) // 2:], sample=True, sampling=SCORED)
        for s, p in prompts.items()])))
    for _ in range(12):
        check(*both("Decode", pb.DecodeRequest(items=[
            pb.DecodeItem(seq_id=s, token_id=t, sampling=SCORED) for s, t in last.items()])))
    for _ in range(4):  # batch 1
        check(*both("Decode", pb.DecodeRequest(items=[
            pb.DecodeItem(seq_id="b", token_id=last["b"], sampling=SCORED)])))
    assert agree >= total - 2, f"{agree} of {total} tokens agree"
    shown = sorted(diffs, reverse=True)[:5]
    print(f"log-probability |TP2 - TP1|: median {sorted(diffs)[len(diffs) // 2]:.4f}, "
          f"largest {[round(d, 4) for d in shown]} of {len(diffs)}")
    assert max(diffs) <= LOGPROB_MAX, shown
    assert sum(d <= LOGPROB_ATOL for d in diffs) >= WITHIN_SHARE * len(diffs), shown
    both("Release", pb.ReleaseRequest(seq_ids=list(prompts)))
