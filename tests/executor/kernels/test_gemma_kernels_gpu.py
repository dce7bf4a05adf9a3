"""The Gemma kernels compiled on the GPU (marker ``gpu``) against the torch ops they
replace (Hugging Face's arithmetic), bf16 and fp16, Gemma 3 12B's row widths."""

from __future__ import annotations

import pytest
import torch

from executor.model.gemma_ops import GEMMA_TORCH_OPS

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

DTYPES = [torch.bfloat16, torch.float16]
EPS = 1e-6


def _randn(*shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def _tol(dtype: torch.dtype) -> dict[str, float]:
    # One rounding at the end on both sides; float32 sums in another order.
    return {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else \
        {"atol": 2e-3, "rtol": 2e-3}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_norms(dtype: torch.dtype, rows: int) -> None:
    from executor.kernels import gemma

    h = 3840
    x, r = _randn(rows, h, dtype=dtype, scale=3.0), _randn(rows, h, dtype=dtype, scale=10.0)
    post, pre = _randn(h, dtype=dtype, scale=0.3), _randn(h, dtype=dtype, scale=0.3)
    torch.testing.assert_close(gemma.gemma_rms_norm(x, post, EPS),
                               GEMMA_TORCH_OPS.norm(x, post, EPS), **_tol(dtype))
    out, s = gemma.gemma_add_norm(x, r, post, pre, EPS)
    want_out, want_s = GEMMA_TORCH_OPS.add_norm(x, r, post, pre, EPS)
    torch.testing.assert_close(s, want_s, **_tol(dtype))
    torch.testing.assert_close(out, want_out, **_tol(dtype))
    qkv = _randn(rows, 32 * 256, dtype=dtype)  # q/k heads as strided views
    q = qkv[:, : 16 * 256].view(rows, 16, 256)
    w = _randn(256, dtype=dtype, scale=0.3)
    torch.testing.assert_close(gemma.gemma_rms_norm(q, w, EPS),
                               GEMMA_TORCH_OPS.norm(q, w, EPS), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 64])
def test_gelu_tanh_and_mul(dtype: torch.dtype, rows: int) -> None:
    from executor.kernels import gemma

    x = _randn(rows, 2 * 15360, dtype=dtype, scale=4.0)
    torch.testing.assert_close(gemma.gelu_tanh_and_mul(x),
                               GEMMA_TORCH_OPS.gelu_tanh_and_mul(x), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qk_norm_rope_in_one_launch(dtype: torch.dtype) -> None:
    """Gemma 3 12B's heads (16 q, 8 kv, 256): the RoPE kernel with Gemma's q/k norm
    against the norm then the rotation."""
    from executor.model.gemma_ops import GEMMA_TRITON_OPS
    from executor.model.layers import RotaryEmbedding
    from executor.model.spec import RopeSpec

    rotary = RotaryEmbedding(RopeSpec(theta=10000.0), 256, 4096)
    rotary.init_tables(torch.device("cuda"))
    qkv = _randn(33, 32 * 256, dtype=dtype, scale=2.0)
    q, k = qkv[:, : 16 * 256].view(33, 16, 256), qkv[:, 16 * 256 : 24 * 256].view(33, 8, 256)
    qw, kw = _randn(256, dtype=dtype, scale=0.3), _randn(256, dtype=dtype, scale=0.3)
    positions = torch.randint(0, 4096, (33,), device="cuda")
    got = GEMMA_TRITON_OPS.norm_rope(positions, q, k, rotary.cos, rotary.sin, qw, kw, EPS)
    want = GEMMA_TORCH_OPS.norm_rope(positions, q, k, rotary.cos, rotary.sin, qw, kw, EPS)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **_tol(dtype))
