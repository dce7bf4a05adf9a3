"""The Gemma kernels (``executor.kernels.gemma``) on CPU under Triton's interpreter, against
the torch ops they replace (``GEMMA_TORCH_OPS``, Hugging Face's arithmetic), and whole tiny
Gemma 2 / Gemma 3 / Phi-3 models, fused path vs torch path, with a window and soft-caps. fp16 and
fp32 (the interpreter's bf16 is unreliable). Skipped on CUDA machines, where
``test_gemma_kernels_gpu.py`` runs the compiled kernels.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: the gpu tests cover the compiled kernels",
                allow_module_level=True)
if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton", reason="triton is not installed")
if type(triton.language.sum).__name__ != "InterpretedFunction":
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set (set it in the "
                "environment or run this file in its own process)", allow_module_level=True)

from executor.config import CacheConfig, ExecutorConfig, ModelConfig  # noqa: E402
from executor.executor import Executor  # noqa: E402
from executor.kernels import gemma  # noqa: E402
from executor.model.gemma_ops import GEMMA_TORCH_OPS, GEMMA_TRITON_OPS, select_gemma_ops  # noqa: E402
from executor.model.layers import TORCH_OPS, TRITON_OPS  # noqa: E402
from tests.helpers.models import write_model  # noqa: E402

DTYPES = [torch.float16, torch.float32]
EPS = 1e-6


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [64, 256, 300])
def test_gemma_rms_norm(dtype: torch.dtype, n: int) -> None:
    x = _randn(5, n, dtype=dtype, seed=1, scale=3.0)
    w = _randn(n, dtype=torch.float32, seed=2, scale=0.3).to(dtype)
    got = gemma.gemma_rms_norm(x, w, EPS)
    want = GEMMA_TORCH_OPS.norm(x, w, EPS)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, atol=1e-3 if dtype == torch.float16 else 1e-5,
                               rtol=1e-3 if dtype == torch.float16 else 1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemma_rms_norm_of_strided_heads(dtype: torch.dtype) -> None:
    """q or k heads as views of a fused QKV output: (T, H, D) with a row stride wider than
    H * D; the output is contiguous."""
    qkv = _randn(4, 3 * 2 * 32, dtype=dtype, seed=3)
    q = qkv[:, : 2 * 32].view(4, 2, 32)
    w = _randn(32, dtype=torch.float32, seed=4, scale=0.3).to(dtype)
    got = gemma.gemma_rms_norm(q, w, EPS)
    assert got.is_contiguous() and got.shape == (4, 2, 32)
    torch.testing.assert_close(got, GEMMA_TORCH_OPS.norm(q, w, EPS), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemma_add_norm(dtype: torch.dtype) -> None:
    x, r = _randn(6, 128, dtype=dtype, seed=5), _randn(6, 128, dtype=dtype, seed=6, scale=4.0)
    post = _randn(128, dtype=torch.float32, seed=7, scale=0.3).to(dtype)
    pre = _randn(128, dtype=torch.float32, seed=8, scale=0.3).to(dtype)
    x_before, r_before = x.clone(), r.clone()
    out, summed = gemma.gemma_add_norm(x, r, post, pre, EPS)
    want_out, want_sum = GEMMA_TORCH_OPS.add_norm(x, r, post, pre, EPS)
    assert torch.equal(x, x_before) and torch.equal(r, r_before)
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(summed, want_sum, atol=tol, rtol=tol)
    torch.testing.assert_close(out, want_out, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [64, 1500])
def test_gelu_tanh_and_mul(dtype: torch.dtype, n: int) -> None:
    x = _randn(3, 2 * n, dtype=dtype, seed=9, scale=4.0)  # saturated tails included
    got = gemma.gelu_tanh_and_mul(x)
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(got, GEMMA_TORCH_OPS.gelu_tanh_and_mul(x), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qk_norm_rope_in_one_launch(dtype: torch.dtype) -> None:
    """Gemma 3's q/k norm inside the RoPE kernel (``offset_norm``) against the norm then
    the rotation (q and k strided views of a fused QKV output)."""
    from executor.model.layers import RotaryEmbedding
    from executor.model.spec import RopeSpec

    rotary = RotaryEmbedding(RopeSpec(theta=10000.0), 32, 64)
    qkv = _randn(5, (4 + 2 * 2) * 32, dtype=dtype, seed=11, scale=2.0)
    q = qkv[:, : 4 * 32].view(5, 4, 32)
    k = qkv[:, 4 * 32 : 6 * 32].view(5, 2, 32)
    qw = _randn(32, dtype=torch.float32, seed=12, scale=0.3).to(dtype)
    kw = _randn(32, dtype=torch.float32, seed=13, scale=0.3).to(dtype)
    positions = torch.tensor([0, 3, 9, 40, 63])
    got = GEMMA_TRITON_OPS.norm_rope(positions, q, k, rotary.cos, rotary.sin, qw, kw, EPS)
    want = GEMMA_TORCH_OPS.norm_rope(positions, q, k, rotary.cos, rotary.sin, qw, kw, EPS)
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=tol, rtol=tol)


def test_gemma_ops_follow_the_layer_ops() -> None:
    assert select_gemma_ops(TRITON_OPS) is GEMMA_TRITON_OPS
    assert select_gemma_ops(TORCH_OPS) is GEMMA_TORCH_OPS


def test_custom_ops_trace_under_dynamo() -> None:
    """Under torch.compile each kernel is one opaque custom-op node with a fake impl."""
    def block(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out, s = gemma.gemma_add_norm(x, r, w, w, EPS)
        return gemma.gelu_tanh_and_mul(torch.cat((out, s), dim=-1)) + gemma.gemma_rms_norm(
            s, w, EPS)

    x, r = _randn(3, 16, dtype=torch.float32, seed=1), _randn(3, 16, dtype=torch.float32,
                                                                seed=2)
    w = _randn(16, dtype=torch.float32, seed=3, scale=0.2)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, r, w), block(x, r, w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "phi3"])
def test_model_fused_matches_torch_path(kind: str, tmp_path: Path) -> None:
    """fp16 logits of a chunked prefill and decode steps past the window: the fused path
    (these kernels and the Llama family's; Phi-3's partial rotary through the RoPE kernel
    on a slice of each head) against the torch path, both over torch_native attention
    (the Triton attention's window and soft-cap: test_window_interpret.py)."""
    path = write_model(tmp_path, kind, seed=4)
    cfg = ExecutorConfig(model=ModelConfig(source=str(path), dtype="float16"), device="cpu",
                         cache=CacheConfig(kv_tokens=256, max_sequences=4, max_context=64))
    ref_ex = Executor(cfg)
    tri_ex = Executor(cfg)
    tri_ex.model.kernels = "triton"
    prompts = {"a": [(i * 7) % 250 + 3 for i in range(13)], "b": [5, 6, 7, 8, 9, 10]}
    chunks = [{s: p[:6] for s, p in prompts.items()},  # the window (8) reaches back
              {s: p[6:] for s, p in prompts.items() if p[6:]},
              {s: [11] for s in prompts}, {s: [12] for s in prompts}]
    outs = []
    for ex_ in (ref_ex, tri_ex):
        steps = []
        for i, chunk in enumerate(chunks):
            phase = "decode" if i >= 2 else "prefill"
            alloc = ex_.kv.allocate([(s, len(c)) for s, c in chunk.items()])
            batch = ex_.build_batch(phase, [t for c in chunk.values() for t in c], alloc,
                                    list(range(len(chunk))) if phase == "decode" else [])
            batch = dataclasses.replace(batch, logits_indices=torch.arange(batch.num_tokens))
            steps.append(ex_.forward_logits(batch))
        outs.append(steps)
    for g, e in zip(outs[1], outs[0], strict=True):
        torch.testing.assert_close(g.float(), e.float(), atol=3e-2, rtol=3e-2)
