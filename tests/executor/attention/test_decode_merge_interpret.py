"""Split decode with the in-kernel merge (``triton_kernels/splits.py``) through Triton's
interpreter, against torch_native: one launch, whose last split per (sequence, KV head)
merges the splits, equal to the reference and to the split + reduce kernels, at head_dim
64/128/256, with windows and soft-caps; the counters it counts on are zero again after
each launch. fp16 only (the interpreter's bf16 ``tl.dot`` is wrong; the GPU tests in
``test_attention_kernels_gpu.py`` run bf16 and fp16 through the same launcher).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: the gpu tests cover the compiled kernels",
                allow_module_level=True)
if "triton" not in sys.modules:  # must precede the first ``import triton``
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton", reason="triton is not installed")
if type(triton.language.sum).__name__ != "InterpretedFunction":
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set (run this file in "
                "its own process)", allow_module_level=True)

from executor.attention.base import AttentionShape  # noqa: E402
from executor.attention.torch_native import TorchNativeBackend  # noqa: E402
from executor.attention.triton_backend import TritonBackend, TritonDecodeMetadata  # noqa: E402
from executor.attention.triton_kernels import decode as d  # noqa: E402
from executor.attention.triton_kernels import splits  # noqa: E402
from tests.helpers.attention_cases import paged_case  # noqa: E402

LAYER = 1


@pytest.mark.parametrize(("prefix_lens", "heads", "kv_heads", "head_dim", "window", "cap"), [
    ([130], 8, 2, 64, 0, 0.0),  # batch 1: every split of one sequence, a partial last one
    ([5, 100], 4, 1, 128, 0, 0.0),  # a short sequence: most of its splits idle
    ([70, 40], 2, 1, 256, 32, 50.0),  # Gemma's head size, a window and a soft-cap
    ([90, 3], 9, 3, 64, 20, 0.0),  # a group of three (a masked head block), a window
    ([100], 4, 2, 64, 0, 1.5),  # soft-cap only
])
def test_merged_split_decode_equals_torch_native(prefix_lens: list[int], heads: int,
                                                  kv_heads: int, head_dim: int, window: int,
                                                  cap: float) -> None:
    pool, table, batch = paged_case(prefix_lens, [1] * len(prefix_lens), heads, kv_heads,
                                    head_dim, seed=head_dim + window)
    shape = AttentionShape(heads, kv_heads, head_dim, head_dim**-0.5,
                           windows=(0, window), softcap=cap)
    gen = torch.Generator().manual_seed(7)
    n = batch.num_tokens
    q = torch.randn(n, heads, head_dim, generator=gen).to(torch.float16)
    k, v = (torch.randn(n, kv_heads, head_dim, generator=gen).to(torch.float16)
            for _ in range(2))
    ref_backend = TorchNativeBackend(shape, pool, table)
    before_k, before_v = pool.k_buffer.clone(), pool.v_buffer.clone()
    want = ref_backend.forward(q, k, v, LAYER, ref_backend.build_metadata(batch))
    tri = TritonBackend(shape, pool, table)
    tri.num_sms = 8  # several splits per sequence at these lengths
    meta = tri.build_metadata(batch)
    assert isinstance(meta, TritonDecodeMetadata) and meta.partial_out is not None
    assert meta.partial_out.shape[2] >= 2
    outs = {}
    for merge in (None, False):  # the launcher's pick (merged here), the reduce kernel
        pool.k_buffer.copy_(before_k)
        pool.v_buffer.copy_(before_v)
        out = torch.full_like(q, float("nan"))
        d.decode_attention(q, k, v, pool.k[LAYER], pool.v[LAYER], table.device_table,
                           meta.slots, meta.seq_lens, meta.out_cache_loc, out,
                           meta.partial_out, meta.partial_lse, shape.scale,
                           window=window, softcap=cap, merge=merge)
        outs[merge] = out
        torch.testing.assert_close(out.float(), want.float(), atol=2e-3, rtol=2e-3)
    # float32 merges of the same partials in two summation orders
    torch.testing.assert_close(outs[None], outs[False], atol=1e-3, rtol=0)
    counters = splits.split_counters(torch.device("cpu"), 1)
    assert counters is not None and not counters.any()  # the last split reset them


def test_counters_serve_small_launches_only() -> None:
    cpu = torch.device("cpu")
    assert splits.split_counters(cpu, splits.MAX_MERGED_PROGRAM_ROWS) is not None
    assert splits.split_counters(cpu, splits.MAX_MERGED_PROGRAM_ROWS + 1) is None
