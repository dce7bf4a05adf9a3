"""Sliding-window and soft-capped Triton attention vs torch_native on the GPU (marker
``gpu``): decode and extend, bf16 and fp16, Gemma's head_dim 256 and a Llama-like 128,
windows shorter than, equal to one token, and longer than the contexts; a decode graph
replayed over a window. Reuses ``test_attention_kernels_gpu``'s pool and batch builder
(scattered slots, every stale table entry a valid location)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from executor.attention import create_backend
from executor.attention.base import AttentionShape
from tests.executor.attention.test_attention_kernels_gpu import Setup, _check, _random_lens

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)


def _windowed(setup: Setup, window: int, cap: float) -> Setup:
    """Layer 1 (the one ``_check`` runs) windowed; layer 0 full."""
    shape: AttentionShape = dataclasses.replace(setup.shape, windows=(0, window), softcap=cap)
    return dataclasses.replace(setup, shape=shape)


DTYPES = [torch.bfloat16, torch.float16]
# (heads, kv_heads, head_dim): Gemma 3 12B's local shape (16/8 heads at 256), a GQA 4 at 128.
SHAPES = [(16, 8, 256), (32, 8, 128)]
# (window, soft-cap): shorter, one token, longer than every context; Gemma 2's cap 50.
WINDOWS = [(64, 0.0), (1, 0.0), (4096, 0.0), (512, 50.0), (0, 50.0)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), SHAPES)
@pytest.mark.parametrize(("window", "cap"), WINDOWS)
def test_windowed_decode(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                         window: int, cap: float) -> None:
    lens = [1, 2, 63, 64, 65, 700, 2000, *_random_lens(9, 1, 2048, seed=window)]
    setup = _windowed(Setup.make(len(lens), max(lens), heads, kv_heads, head_dim, dtype),
                      window, cap)
    _check(setup, setup.batch("decode", [n - 1 for n in lens], [1] * len(lens)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), SHAPES)
@pytest.mark.parametrize(("window", "cap"), WINDOWS)
def test_windowed_extend(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                         window: int, cap: float) -> None:
    """Prefills, chunked prefills (the window reaching into the cached prefix) and
    decode-like rows in one packed batch."""
    prefix = [0, 0, 100, 1000, 37, 5]
    new = [1, 700, 300, 129, 1, 64]
    setup = _windowed(Setup.make(len(prefix), max(p + n for p, n in zip(prefix, new,
                                                                         strict=True)),
                                 heads, kv_heads, head_dim, dtype), window, cap)
    _check(setup, setup.batch("prefill", prefix, new))


@pytest.mark.parametrize("bucket", [1, 8])
def test_windowed_decode_graph_replay_matches_eager(bucket: int) -> None:
    """A decode graph captured over the static buffers, replayed for real lengths on both
    sides of the window, equals the eager launch."""
    lens = _random_lens(bucket, 1, 1500, seed=bucket)
    setup = _windowed(Setup.make(bucket, max(lens) + 8, 16, 8, 256, torch.bfloat16), 128,
                      50.0)
    tri = create_backend("triton", setup.shape, setup.pool, setup.table)
    tri.init_graph_buffers(bucket, bucket)
    meta = tri.capture_metadata("decode", bucket, bucket)
    q, k, v = setup.qkv(bucket)
    out = torch.empty_like(q)
    tri.forward_into(q, k, v, out, 1, meta)  # warm-up (compiles)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tri.forward_into(q, k, v, out, 1, meta)
    for step in range(3):
        batch = setup.batch("decode", [n - 1 + step for n in lens], [1] * bucket)
        tri.refresh_metadata(meta, batch)
        graph.replay()
        eager = tri.forward(q, k, v, 1, tri.build_metadata(batch))
        torch.testing.assert_close(out, eager, atol=2e-2, rtol=2e-2)
