"""Sliding-window and soft-capped attention: the Triton kernels (through Triton's
interpreter) against torch_native, and torch_native against a dense reference built from
Hugging Face's mask definition (a query at position p sees keys at positions in
``(p - window, p]``).

Tiny shapes so the interpreter stays fast; head_dim 256 (Gemma) included. fp16 only in
the interpreter (its bf16 ``tl.dot`` is wrong as of Triton 3.9); the GPU twin
(``test_window_kernels_gpu.py``) runs bf16 and fp16 compiled.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from executor.attention.base import AttentionShape
from executor.attention.torch_native import TorchNativeBackend
from tests.helpers.attention_cases import paged_case

LAYER = 1  # of 2; layer 0 keeps full attention in every windowed case


def _qkv(n: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
         seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    return (q.view(n, heads, head_dim), k.view(n, kv_heads, head_dim),
            v.view(n, kv_heads, head_dim))


def _dense_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     positions: torch.Tensor, scale: float, window: int, cap: float
                     ) -> torch.Tensor:
    """float64 attention of queries at ``positions`` over keys at 0 .. len - 1, masked as
    transformers' ``sliding_window_overlay`` and causal masks: ``kv > q - window``."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)  # (heads, L, d)
    v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    s = torch.matmul(q.double().transpose(0, 1), k.transpose(1, 2)) * scale  # (h, n, L)
    if cap:
        s = torch.tanh(s / cap) * cap
    kv_idx = torch.arange(keys.shape[0])[None, :]
    q_idx = positions[:, None]
    visible = kv_idx <= q_idx
    if window:
        visible &= kv_idx > q_idx - window
    s = s.masked_fill(~visible, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v).transpose(0, 1)


@pytest.mark.parametrize(("window", "cap"), [(3, 0.0), (1, 0.0), (40, 0.0), (0, 5.0),
                                             (7, 2.0)])
def test_torch_native_matches_the_hf_mask_definition(window: int, cap: float) -> None:
    """One sequence: a cached prefix of 12 and 9 new tokens; windows shorter than, equal
    to one token, and longer than the context; soft-cap alone and with a window."""
    heads, kv_heads, dim = 4, 2, 8
    pool, table, batch = paged_case([12], [9], heads, kv_heads, dim, seed=1,
                                    dtype=torch.float32)
    shape = AttentionShape(heads, kv_heads, dim, dim**-0.5, windows=(0, window), softcap=cap)
    q, k, v = _qkv(9, heads, kv_heads, dim, torch.float32, seed=2)
    backend = TorchNativeBackend(shape, pool, table)
    out = backend.forward(q, k, v, LAYER, backend.build_metadata(batch))
    locs = table.device_table[batch.slots_host[0], :21].long()
    want = _dense_reference(q, pool.k[LAYER][locs], pool.v[LAYER][locs],
                            torch.arange(12, 21), dim**-0.5, window, cap)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def _interpreter() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present: test_window_kernels_gpu.py covers the compiled kernels")
    if "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    triton = pytest.importorskip("triton", reason="triton is not installed")
    if type(triton.language.sum).__name__ != "InterpretedFunction":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set")


def _against_torch_native(prefix_lens: list[int], new_lens: list[int], heads: int,
                          kv_heads: int, head_dim: int, window: int, cap: float,
                          num_sms: int | None = None) -> None:
    _interpreter()
    from executor.attention.triton_backend import TritonBackend

    dtype = torch.float16
    pool, table, batch = paged_case(prefix_lens, new_lens, heads, kv_heads, head_dim, seed=3,
                                    dtype=dtype)
    shape = AttentionShape(heads, kv_heads, head_dim, head_dim**-0.5, windows=(0, window),
                           softcap=cap)
    q, k, v = _qkv(batch.num_tokens, heads, kv_heads, head_dim, dtype, seed=4)
    tri = TritonBackend(shape, pool, table)
    if num_sms is not None:
        tri.num_sms = num_sms
    before_k, before_v = pool.k_buffer.clone(), pool.v_buffer.clone()
    out = tri.forward(q, k, v, LAYER, tri.build_metadata(batch))
    got_k, got_v = pool.k_buffer.clone(), pool.v_buffer.clone()
    pool.k_buffer.copy_(before_k)
    pool.v_buffer.copy_(before_v)
    ref = TorchNativeBackend(shape, pool, table)
    want = ref.forward(q, k, v, LAYER, ref.build_metadata(batch))
    assert torch.equal(pool.k_buffer, got_k) and torch.equal(pool.v_buffer, got_v)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize(("prefix_lens", "window", "num_sms"), [
    ([5, 40, 130], 16, None),  # window shorter than most contexts, several splits
    ([5, 40, 130], 1, None),  # the new token alone
    ([5, 40, 130], 300, None),  # longer than every context: as full attention
    ([100, 37], 33, 1),  # one split, no reduction kernel
    ([70, 200], 64, 3),  # a window inside a split boundary: idle splits
])
def test_windowed_decode_interpreted(prefix_lens: list[int], window: int,
                                     num_sms: int | None) -> None:
    _against_torch_native(prefix_lens, [1] * len(prefix_lens), 8, 2, 16, window, 0.0,
                          num_sms)


@pytest.mark.parametrize(("prefix_lens", "new_lens", "window"), [
    ([0], [150], 20),  # prefill longer than the window over three query tiles
    ([0, 20, 70], [70, 5, 1], 9),  # prefill, chunked prefill, a decode-like row
    ([90, 3], [70, 40], 64),  # the window reaches into the cached prefix
    ([0, 30], [20, 10], 500),  # longer than every context
])
def test_windowed_extend_interpreted(prefix_lens: list[int], new_lens: list[int],
                                     window: int) -> None:
    _against_torch_native(prefix_lens, new_lens, 4, 2, 16, window, 0.0)


@pytest.mark.parametrize(("prefix_lens", "new_lens", "window", "cap"), [
    ([40, 3], [1, 1], 0, 1.5),  # decode, soft-cap only
    ([40, 3], [1, 1], 8, 1.5),  # decode, soft-cap and window
    ([20, 0], [6, 70], 0, 1.5),  # extend, soft-cap only
    ([20, 0], [6, 70], 10, 1.5),  # extend, soft-cap and window
])
def test_softcap_interpreted(prefix_lens: list[int], new_lens: list[int], window: int,
                             cap: float) -> None:
    _against_torch_native(prefix_lens, new_lens, 4, 2, 16, window, cap)


@pytest.mark.parametrize(("prefix_lens", "new_lens", "window"), [
    ([70, 5], [1, 1], 32),  # decode
    ([40], [30], 16),  # chunked prefill
])
def test_head_dim_256_interpreted(prefix_lens: list[int], new_lens: list[int],
                                  window: int) -> None:
    """Gemma's head size, with a window and a soft-cap."""
    _against_torch_native(prefix_lens, new_lens, 2, 1, 256, window, 50.0)


def test_fixed_grid_extend_with_a_window_interpreted() -> None:
    """Prefill graph mode ``fixed_grid``: windowed and capped, the kernel whose grid the
    bucket fixes equals the eager one (the second sequence starts mid-block)."""
    _interpreter()
    from executor.attention.triton_backend import TritonBackend

    heads, kv_heads, dim, bucket = 4, 2, 16, 128
    pool, table, batch = paged_case([0, 30], [70, 20], heads, kv_heads, dim, seed=5)
    shape = AttentionShape(heads, kv_heads, dim, dim**-0.5, windows=(0, 24), softcap=3.0)
    tri = TritonBackend(shape, pool, table)
    tri.init_graph_buffers(bucket, bucket, "prefill")
    meta = tri.capture_metadata("prefill", bucket, bucket)
    q, k, v = _qkv(bucket, heads, kv_heads, dim, torch.float16, seed=6)
    n = batch.num_tokens
    eager = tri.forward(q[:n], k[:n], v[:n], LAYER, tri.build_metadata(batch))
    tri.refresh_metadata(meta, batch)
    out = torch.full((bucket, heads, dim), float("nan"), dtype=torch.float16)
    tri.forward_into(q, k, v, out, LAYER, meta)
    assert out[n:].isnan().all()
    torch.testing.assert_close(out[:n].float(), eager.float(), atol=2e-3, rtol=2e-3)


def test_flashinfer_refuses_windows_and_softcaps_in_one_line() -> None:
    """Its wrappers are not given per-layer windows or caps: refused at start-up (before
    any probe or import), and ``auto`` passes it over."""
    from executor.attention.flashinfer_backend import flashinfer_unusable

    cuda = torch.device("cuda")
    for shape, named in ((AttentionShape(8, 2, 256, 0.0625, windows=(4096, 0)),
                          "sliding_window"),
                         (AttentionShape(8, 2, 256, 0.0625, softcap=50.0), "attn_softcap")):
        why = flashinfer_unusable(cuda, torch.bfloat16, shape,
                                  lambda *_: pytest.fail("probed"))  # type: ignore[arg-type]
        assert why is not None and named in why and "use triton" in why
        assert "\n" not in why
    assert AttentionShape(8, 2, 128, 0.1).features == ()
