"""FP8 under tensor parallelism on two FP8 GPUs (marker ``gpu``; skips with fewer or
below compute capability 8.9): a block-wise FP8 checkpoint served at
``--tensor-parallel-size 2`` (each rank its slices of the weights and of their 128x128
block scales) against ``--tensor-parallel-size 1``, both replaying graphs; and a bf16
checkpoint with ``--quantization fp8`` at TP = 2 (each rank quantizes its own slices, so
row-parallel scales differ from TP = 1's: agreement, not equality, is asked).

The servers get the same calls and decode TP = 1's tokens. Where TP = 1's top-2
log-probability margin exceeds ``MARGIN`` the block checkpoint's tokens must be equal, and
every log-probability within 0.1. ``MARGIN`` is three bf16 steps of these logits (random
weights give logits of 8-16, where bf16 steps by 0.0625): the row-parallel halves are
rounded to bf16 before their sum, so ties within a step or two may flip."""

from __future__ import annotations

import subprocess
from pathlib import Path

import grpc
import pytest
import torch

from bench.e2e.tensor_parallel import serve, stop
from service.gen.model_executor.v1 import executor_pb2 as pb
from service.gen.model_executor.v1 import executor_pb2_grpc as pb_grpc
from tests.helpers.fp8_models import write_fp8_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    torch.cuda.device_count() < 2 or torch.cuda.get_device_capability() < (8, 9),
    reason="needs 2 GPUs of compute capability 8.9+")]

SCORED = pb.SamplingParams(logprobs=True, top_logprobs=2)
MARGIN, LOGPROB_ATOL = 0.19, 0.1
# head_dim 64 with 4 KV heads: 128 k/v rows per rank at TP = 2 (whole blocks)
SHAPE = dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, head_dim=64,
             max_position_embeddings=4096)


def _run(model: Path, extra: list[str], name: str) -> tuple[int, int, bool]:
    """(tokens agreeing, tokens, whether every clear choice agreed) of TP = 2 against
    TP = 1 over a chunked prefill of 3 prompts and 12 decode steps."""
    procs: list[subprocess.Popen[bytes]] = []
    stubs = []
    try:
        for tp in (1, 2):
            proc, target, _ = serve(model, tp, extra)
            procs.append(proc)
            stubs.append(pb_grpc.ExecutorStub(grpc.insecure_channel(target)))
        for stub in stubs:
            info = stub.Health(pb.HealthRequest(), timeout=10).model
            assert (info.weight_format, info.quantization) == ("fp8_e4m3", name)
        gen = torch.Generator().manual_seed(0)
        prompts = {s: torch.randint(3, 4096, (n,), generator=gen).tolist()
                   for s, n in (("a", 300), ("b", 45), ("c", 700))}
        outs = [stub.Prefill(pb.PrefillRequest(items=[
            pb.PrefillItem(seq_id=s, token_ids=p, sample=True, sampling=SCORED)
            for s, p in prompts.items()]), timeout=120) for stub in stubs]
        agree = total = 0
        clear = True
        misses: list[str] = []  # what broke ``clear``, for the failure message
        for k in range(13):
            last = {}
            for ro, go in zip(outs[0].outputs, outs[1].outputs, strict=True):
                (_, lp1), (_, lp2) = [(t.token_id, t.logprob) for t in ro.top_logprobs]
                same = ro.token_id == go.token_id
                gap = abs(ro.logprob - go.logprob)
                if not (same or lp1 - lp2 <= MARGIN) or gap > LOGPROB_ATOL:
                    clear = False
                    misses.append(f"step {k} {ro.seq_id}: tokens {ro.token_id}/{go.token_id} "
                                  f"margin {lp1 - lp2:.3f} logprob gap {gap:.3f}")
                agree += same
                total += 1
                last[ro.seq_id] = ro.token_id
            outs = [stub.Decode(pb.DecodeRequest(items=[
                pb.DecodeItem(seq_id=s, token_id=t, sampling=SCORED) for s, t in last.items()]),
                timeout=120) for stub in stubs]
            assert all(o.step.path == pb.PATH_GRAPH for o in outs)
        if misses:
            print("\n" + "\n".join(misses[:12]))
        return agree, total, clear
    finally:
        for proc in procs:
            stop(proc)


def test_block_fp8_checkpoint_tp2_equals_tp1(tmp_path: Path) -> None:
    model = write_fp8_model(tmp_path / "fp8", "block", **SHAPE)
    agree, total, clear = _run(model, [], "fp8_block_128x128")
    assert clear and agree >= 0.8 * total, f"{agree} of {total} tokens agree"


def test_quantization_fp8_at_tp2_agrees_with_tp1(tmp_path: Path) -> None:
    from executor.weights.random_weights import write_random_model
    from tests.helpers.fp8_models import fp8_config

    model = write_random_model(tmp_path / "bf16", fp8_config(SHAPE), seed=3,
                               dtype=torch.bfloat16)
    agree, total, _ = _run(model, ["--quantization", "fp8"], "fp8_at_load")
    print(f"\n--quantization fp8, TP = 2 against TP = 1: {agree} of {total} tokens agree")
    assert agree >= 0.8 * total
