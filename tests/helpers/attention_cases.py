"""Paged-attention test cases shared by the CPU backend tests (Triton interpreter, the
FlashInfer adapter): a KV pool of random K/V and a batch over scattered slots/locations."""

from __future__ import annotations

import torch

from executor.api import Phase
from executor.forward_batch import ForwardBatch
from executor.kv.manager import Allocation, Extension
from executor.kv.pool import KVPool, ReqToTokenTable


def paged_case(prefix_lens: list[int], new_lens: list[int], heads: int, kv_heads: int,
               head_dim: int, seed: int, dtype: torch.dtype = torch.float16,
               shared: int = 0) -> tuple[KVPool, ReqToTokenTable, ForwardBatch]:
    """A two-layer pool full of random K/V, sequences at scattered locations in scattered
    slots; every table entry past a sequence's length is stale (a valid other location).
    ``shared``: every later sequence's first ``shared`` prefix tokens are the first
    sequence's locations (forks of it)."""
    del heads  # the pool has kv_heads only; kept so cases read (heads, kv_heads, head_dim)
    gen = torch.Generator().manual_seed(seed)
    batch, total = len(prefix_lens), sum(prefix_lens) + sum(new_lens)
    num_locations = total + 5
    max_context = max(p + n for p, n in zip(prefix_lens, new_lens, strict=True)) + 3
    pool = KVPool(2, num_locations, kv_heads, head_dim, dtype, torch.device("cpu"))
    pool.k_buffer.copy_(torch.randn(pool.k_buffer.shape, generator=gen))
    pool.v_buffer.copy_(torch.randn(pool.v_buffer.shape, generator=gen))
    table = ReqToTokenTable(batch + 2, max_context, torch.device("cpu"))
    # Stale entries everywhere: a read past a sequence's length would change the result.
    table.device_table.copy_(torch.randint(0, num_locations + 1, table.device_table.shape,
                                           generator=gen, dtype=torch.int32))
    slots = torch.randperm(batch + 2, generator=gen)[:batch].tolist()
    locs = (torch.randperm(num_locations, generator=gen)[:total] + 1).tolist()
    exts, new_locs = [], []
    first: list[int] = []
    for i, (slot, p, n) in enumerate(zip(slots, prefix_lens, new_lens, strict=True)):
        seq_locs, locs = locs[: p + n], locs[p + n :]
        if i and shared:
            k = min(shared, p, prefix_lens[0])
            seq_locs[:k] = first[:k]
        if i == 0:
            first = seq_locs
        table.device_table[slot, : p + n] = torch.tensor(seq_locs, dtype=torch.int32)
        new_locs.extend(seq_locs[p:])
        exts.append(Extension(f"s{i}", slot, p, n, p == 0))
    out_loc = torch.tensor(new_locs, dtype=torch.int64)
    phase: Phase = "decode" if all(n == 1 for n in new_lens) and all(prefix_lens) else "prefill"
    fb = ForwardBatch.build(phase, [0] * len(new_locs), Allocation(tuple(exts), out_loc),
                            [], torch.device("cpu"), table.max_context)
    return pool, table, fb
