"""torch_native's decode batch (one new token per sequence, one attention call for all of
them over keys padded to the longest sequence) against a float64 dense reference per
sequence: grouped heads, sliding windows, soft-caps, and table entries past each
sequence's end that hold other sequences' locations (masked out).
"""

from __future__ import annotations

import pytest
import torch

from executor.attention.base import AttentionShape
from executor.attention.torch_native import TorchNativeBackend
from tests.helpers.attention_cases import paged_case

LAYER = 1  # of 2; layer 0 keeps full attention


def _qkv(n: int, heads: int, kv_heads: int, dim: int, seed: int
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, heads, dim, generator=gen),
            torch.randn(n, kv_heads, dim, generator=gen),
            torch.randn(n, kv_heads, dim, generator=gen))


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
               window: int, cap: float) -> torch.Tensor:
    """float64 attention of one query (heads, d) at the last of ``keys`` (L, kv_heads, d):
    it sees keys at positions > L - 1 - window (Hugging Face's sliding window)."""
    group = q.shape[0] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)  # (heads, L, d)
    v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    s = torch.einsum("hd,hld->hl", q.double(), k) * scale
    if cap:
        s = torch.tanh(s / cap) * cap
    pos = torch.arange(keys.shape[0])
    if window:
        s = s.masked_fill(pos <= keys.shape[0] - 1 - window, float("-inf"))
    return torch.einsum("hl,hld->hd", torch.softmax(s, dim=-1), v)


@pytest.mark.parametrize(("heads", "kv_heads", "window", "cap"), [
    (8, 2, 0, 0.0), (4, 4, 0, 0.0), (6, 3, 5, 0.0), (4, 1, 1, 0.0), (4, 2, 0, 7.0),
    (4, 2, 9, 3.0)])
def test_decode_batch_matches_a_dense_reference(heads: int, kv_heads: int, window: int,
                                                cap: float) -> None:
    prefix_lens = [0, 17, 4, 40, 9]
    dim = 8
    pool, table, batch = paged_case(prefix_lens, [1] * len(prefix_lens), heads, kv_heads,
                                    dim, seed=5, dtype=torch.float32)
    shape = AttentionShape(heads, kv_heads, dim, dim**-0.5, windows=(0, window), softcap=cap)
    q, k, v = _qkv(len(prefix_lens), heads, kv_heads, dim, seed=6)
    backend = TorchNativeBackend(shape, pool, table)
    meta = backend.build_metadata(batch)
    assert meta.decode_locations is not None  # (the batched path)
    out = backend.forward(q, k, v, LAYER, meta)
    for i, (slot, prefix) in enumerate(zip(batch.slots_host, prefix_lens, strict=True)):
        locs = table.device_table[slot, : prefix + 1].long()
        # (the new token's K/V were stored at its location by the forward)
        want = _reference(q[i], pool.k[LAYER][locs], pool.v[LAYER][locs], dim**-0.5, window,
                          cap)
        torch.testing.assert_close(out[i].double(), want, atol=1e-5, rtol=1e-5)



def test_a_batch_with_an_extend_row_takes_the_per_sequence_path() -> None:
    pool, table, batch = paged_case([3, 25], [1, 4], 4, 2, 8, seed=7, dtype=torch.float32)
    backend = TorchNativeBackend(AttentionShape(4, 2, 8, 8**-0.5), pool, table)
    meta = backend.build_metadata(batch)
    assert meta.decode_locations is None and len(meta.kv_locations) == 2
