"""FP8 checkpoints through the real server on CPU, at TP = 1 and TP = 2 (gloo).

Each format (block-wise ``quant_method: fp8``, compressed-tensors per-channel and
per-tensor, ModelOpt per-tensor) is written from random bf16 weights by the test helper
(a Llama; for mixtures of experts, the experts quantized too) and served; the reference
is Hugging Face transformers (float32) on the same FP8 values dequantized to float32. CPU
has no FP8, so the server dequantizes once at load (Health says so) and must match the
reference: greedy tokens identical for 3 prompts x 32 steps, and every sampled token's
log-probability (the first one is the last prompt position's) within ``LOGPROB_ATOL``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from service.gen.model_executor.v1 import executor_pb2 as pb
from tests.helpers.fp8_models import Format, write_dequantized, write_fp8_model
from tests.helpers.serving import ServeProcess

#: float32 log-probabilities against HF float32 on the same weights (sums in another
#: order; measured differences are ~1e-6).
LOGPROB_ATOL = 1e-4
PROMPTS = [[1, 17, 99, 4, 250, 311, 8], [1] + [(i * 37) % 500 + 3 for i in range(20)],
           [1, 400, 2, 3]]
STEPS = 32
ARGS = ["--kv-tokens", "512", "--max-context", "128", "--max-sequences", "4",
        "--drain-delay", "0"]
NAMES = {"block": "fp8_block_128x128", "channel": "fp8_per_channel_dynamic",
         "tensor": "fp8_per_tensor", "modelopt": "fp8_per_tensor"}


def reference(path: Path) -> tuple[list[list[int]], list[list[float]]]:
    """HF greedy tokens and their log-probabilities, float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tokens, logprobs = [], []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids, past = torch.tensor([prompt]), None
            out, lps = [], []
            for _ in range(STEPS):
                step = model(ids, past_key_values=past, use_cache=True)
                past = step.past_key_values
                logp = step.logits[0, -1].float().log_softmax(-1)
                tok = int(logp.argmax())
                out.append(tok)
                lps.append(float(logp[tok]))
                ids = torch.tensor([[tok]])
            tokens.append(out)
            logprobs.append(lps)
    return tokens, logprobs


DENSE_PATHS = frozenset({"qkv_proj", "o_proj", "gate_up_proj", "down_proj"})


def serve(path: Path, tp: int, name: str, paths_of: frozenset[str] = DENSE_PATHS
          ) -> tuple[list[list[int]], list[list[float]]]:
    args = [*ARGS, "--model", str(path)] + (["--tensor-parallel-size", str(tp)] if tp > 1
                                            else [])
    server = ServeProcess(args)
    try:
        server.wait_ready()
        model = server.stub.Health(pb.HealthRequest(), timeout=10).model
        assert (model.quantization, model.weight_format) == (name, "float32")
        paths = server.wait_for("fp8_gemm_paths", timeout=10)["paths"]
        assert set(paths) == paths_of
        assert all(p.startswith("dequantized at load") for p in paths.values())
        sampling = pb.SamplingParams(logprobs=True)
        first = server.stub.Prefill(pb.PrefillRequest(items=[
            pb.PrefillItem(seq_id=str(i), token_ids=p, sample=True, sampling=sampling)
            for i, p in enumerate(PROMPTS)]), timeout=60)
        tokens = [[o.token_id] for o in first.outputs]
        logprobs = [[o.logprob] for o in first.outputs]
        rest = server.stub.Decode(pb.DecodeRequest(items=[
            pb.DecodeItem(seq_id=str(i), use_last_sampled=True, sampling=sampling)
            for i in range(len(PROMPTS))], num_steps=STEPS - 1), timeout=120)
        for o in rest.outputs:
            tokens[int(o.seq_id)] += [s.token_id for s in o.steps]
            logprobs[int(o.seq_id)] += [s.logprob for s in o.steps]
        return tokens, logprobs
    finally:
        assert server.stop() == 0, "".join(server.lines)[-3000:]


# TP = 2 for each scale layout (block scales cut with their blocks, per-channel scales
# with their rows or replicated, per-tensor scalars replicated), TP = 1 through the server
# once (every format at TP = 1 in process: tests/executor/quant/test_fp8_loading.py). The
# compressed-tensors per-tensor layout differs from ModelOpt's only in its config and
# scalar shapes (both loaded in process there).
@pytest.mark.parametrize(("fmt", "sizes"), [("block", (1, 2)), ("channel", (2,)),
                                            ("modelopt", (2,))])
def test_fp8_checkpoint_serves_its_dequantized_values(fmt: Format, sizes: tuple[int, ...],
                                                      tmp_path: Path) -> None:
    fp8 = write_fp8_model(tmp_path / fmt, fmt)
    want_tokens, want_lps = reference(write_dequantized(fp8, tmp_path / "ref"))
    for tp in sizes:
        tokens, lps = serve(fp8, tp, NAMES[fmt])
        assert tokens == want_tokens, f"TP={tp}"
        for got, want in zip(lps, want_lps, strict=True):
            assert got == pytest.approx(want, abs=LOGPROB_ATOL), f"TP={tp}"


# Mixture of experts: the experts' scales follow their rows (gate, up) and columns (down)
# under TP = 2; Qwen3-MoE's dense layer keeps its MLP projections. (Per-tensor expert
# scales, repeated over their rows at load: in process, test_fp8_moe_loading.py.)
@pytest.mark.parametrize(("moe", "fmt", "sizes", "paths"), [
    ("qwen3_moe", "block", (1, 2), DENSE_PATHS | {"experts"}),
    ("mixtral", "channel", (2,), frozenset({"qkv_proj", "o_proj", "experts"}))])
def test_fp8_moe_checkpoint_serves_its_dequantized_values(
        moe: str, fmt: Format, sizes: tuple[int, ...], paths: frozenset[str],
        tmp_path: Path) -> None:
    fp8 = write_fp8_model(tmp_path / fmt, fmt, moe=moe)
    want_tokens, want_lps = reference(write_dequantized(fp8, tmp_path / "ref"))
    for tp in sizes:
        tokens, lps = serve(fp8, tp, NAMES[fmt], paths)
        assert tokens == want_tokens, f"TP={tp}"
        for got, want in zip(lps, want_lps, strict=True):
            assert got == pytest.approx(want, abs=LOGPROB_ATOL), f"TP={tp}"


def test_quantization_flag_serves_tiny_and_health_says_so() -> None:
    server = ServeProcess([*ARGS, "--model", "tiny", "--quantization", "fp8"])
    try:
        server.wait_ready()
        model = server.stub.Health(pb.HealthRequest(), timeout=10).model
        assert (model.quantization, model.weight_format) == ("fp8_at_load", "float32")
        ready = server.wait_for("executor_ready", timeout=10)
        assert (ready["quantization"], ready["weight_format"]) == ("fp8_at_load", "float32")
        out = server.stub.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(
            seq_id="a", token_ids=[1, 2, 3], sample=True)]), timeout=60).outputs[0]
        assert 0 <= out.token_id < 512
    finally:
        assert server.stop() == 0, "".join(server.lines)[-3000:]
