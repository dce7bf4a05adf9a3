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
from tests.executor.attention.test_window_interpret import _dense_reference, _qkv
from tests.helpers.attention_cases import paged_case

LAYER = 1  # of 2; layer 0 keeps full attention


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
    q, k, v = _qkv(len(prefix_lens), heads, kv_heads, dim, torch.float32, seed=6)
    backend = TorchNativeBackend(shape, pool, table)
    meta = backend.build_metadata(batch)
    assert meta.decode_locations is not None  # (the batched path)
    out = backend.forward(q, k, v, LAYER, meta)
    for i, (slot, prefix) in enumerate(zip(batch.slots_host, prefix_lens, strict=True)):
        locs = table.device_table[slot, : prefix + 1].long()
        want = _dense_reference(q[i : i + 1], pool.k[LAYER][locs], pool.v[LAYER][locs],
                                torch.tensor([prefix]), dim**-0.5, window, cap)
        torch.testing.assert_close(out[i : i + 1].double(), want, atol=1e-5, rtol=1e-5)



def test_a_batch_with_an_extend_row_takes_the_per_sequence_path() -> None:
    pool, table, batch = paged_case([3, 25], [1, 4], 4, 2, 8, seed=7, dtype=torch.float32)
    backend = TorchNativeBackend(AttentionShape(4, 2, 8, 8**-0.5), pool, table)
    meta = backend.build_metadata(batch)
    assert meta.decode_locations is None and len(meta.kv_locations) == 2
