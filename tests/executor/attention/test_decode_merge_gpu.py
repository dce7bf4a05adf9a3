"""The split decode kernel's in-kernel merge on the GPU (``triton_kernels/splits.py``):
the merged launch equals the split + reduce kernels and a float32 dense reference (bf16
and fp16; head_dim 64, 128 and 256; 8, 4 and 3 KV heads; a window with a soft-cap) at
batch 1 and 8, also captured in a CUDA graph and replayed with other lengths, and it
leaves its counters at zero."""

from __future__ import annotations

import pytest
import torch

from executor.attention.base import AttentionShape
from executor.attention.triton_backend import TritonBackend
from executor.attention.triton_kernels import decode as d
from executor.attention.triton_kernels import splits
from executor.kv.pool import KVPool, ReqToTokenTable

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
DEV = torch.device("cuda")
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
CONTEXT = 512
LENS = [511, 40, 1, 300, 511, 7, 100, 511]  # cached tokens per row, batch 8


def _dense(shape: AttentionShape, pool: KVPool, table: ReqToTokenTable, q: torch.Tensor,
           seq_lens: torch.Tensor) -> torch.Tensor:
    """float32 attention of row i's query over slot i's first ``seq_len`` locations (the
    new K/V stored there by the kernel), windowed and soft-capped as ``shape`` says."""
    outs = []
    group = shape.num_heads // shape.num_kv_heads
    window = shape.window(1)
    for i in range(q.shape[0]):
        n = int(seq_lens[i])
        locs = table.device_table[i, :n].long()
        kk = pool.k[1][locs].float().repeat_interleave(group, dim=1)  # (n, heads, d)
        vv = pool.v[1][locs].float().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q[i].float(), kk) * shape.scale
        if shape.softcap:
            s = torch.tanh(s / shape.softcap) * shape.softcap
        if window:
            s[:, : max(n - window, 0)] = float("-inf")
        outs.append(torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), vv))
    return torch.stack(outs).to(q.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "window", "cap"), [
    (32, 8, 128, 0, 0.0), (16, 4, 128, 0, 0.0), (32, 8, 64, 0, 0.0), (8, 4, 256, 64, 50.0),
    (9, 3, 64, 0, 0.0)])
def test_merged_decode_equals_reduce_kernel_and_reference(dtype: torch.dtype, heads: int,
                                                           kv_heads: int, head_dim: int,
                                                           window: int, cap: float) -> None:
    shape = AttentionShape(heads, kv_heads, head_dim, head_dim**-0.5, windows=(0, window),
                           softcap=cap)
    torch.manual_seed(0)
    pool = KVPool(2, 8 * CONTEXT + 1, kv_heads, head_dim, dtype, DEV)
    pool.k_buffer.normal_()
    pool.v_buffer.normal_()
    table = ReqToTokenTable(8, CONTEXT, DEV)
    table.device_table.copy_((torch.randperm(8 * CONTEXT, device=DEV) + 1).view(8, CONTEXT)
                             .to(torch.int32))
    for b in (1, 8):
        _check(shape, pool, table, b, window, cap, TOLERANCE[dtype])
    counters = splits.split_counters(DEV, 1)
    assert counters is not None and not counters.any()


def _check(shape: AttentionShape, pool: KVPool, table: ReqToTokenTable, b: int, window: int,
           cap: float, tol: float) -> None:
    dtype = pool.dtype
    heads, kv_heads, head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
    seq_lens = torch.tensor(LENS[:b], device=DEV) + 1
    slots = torch.arange(b, device=DEV)
    loc = table.device_table[slots, seq_lens - 1].long()
    q = torch.randn(b, heads, head_dim, device=DEV, dtype=dtype)
    k, v = (torch.randn(b, kv_heads, head_dim, device=DEV, dtype=dtype) for _ in range(2))
    n = TritonBackend(shape, pool, table).num_splits(b)
    assert n > 1
    mid_o = torch.empty(b, heads, n, head_dim, device=DEV)
    mid_lse = torch.empty(b, heads, n, device=DEV)

    def run(out: torch.Tensor, merge: bool | None, lens: torch.Tensor) -> None:
        d.decode_attention(q, k, v, pool.k[1], pool.v[1], table.device_table, slots, lens,
                           loc, out, mid_o, mid_lse, shape.scale, window=window, softcap=cap,
                           merge=merge)

    merged, reduced = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    run(merged, None, seq_lens)
    run(reduced, False, seq_lens)
    torch.testing.assert_close(merged, reduced, atol=tol, rtol=tol)
    torch.testing.assert_close(merged, _dense(shape, pool, table, q, seq_lens), atol=tol,
                               rtol=tol)
    # Captured (the counters exist: allocated by the eager launch above), then replayed
    # with other lengths: the counters reset themselves between launches.
    lens_s = seq_lens.clone()
    out_s = torch.empty_like(q)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(out_s, None, lens_s)
    for shift in (0, -37, -200):
        lens_s.copy_((seq_lens + shift).clamp_min(1))
        graph.replay()
        want = torch.empty_like(q)
        run(want, False, lens_s)
        torch.testing.assert_close(out_s, want, atol=tol, rtol=tol)
