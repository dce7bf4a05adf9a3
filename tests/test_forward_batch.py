"""``ForwardBatch.build`` packs the same batch whichever way it builds it.

Short batches are packed from Python lists, long ones with tensor ops; both must give the
layout the kernels rely on, checked here against a plain per-token reference on random
mixes of new and continuing sequences.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from executor import forward_batch
from executor.forward_batch import ForwardBatch
from executor.kv.manager import Allocation, Extension

_WIDTH = 97  # request-slot table row length: not a power of two, so a wrong stride shows
seqs = st.lists(st.tuples(st.integers(0, 40), st.integers(1, 30)), min_size=1, max_size=6)


def _case(spec: list[tuple[int, int]]) -> tuple[list[int], Allocation, list[int]]:
    exts = tuple(Extension(f"s{i}", 10 + 3 * i, prefix, new, prefix == 0)
                 for i, (prefix, new) in enumerate(spec))
    total = sum(new for _, new in spec)
    locs = torch.randperm(1000, generator=torch.Generator().manual_seed(total))[:total] + 1
    tokens = [(7 * j + 3) % 500 for j in range(total)]
    rows = [i for i in range(len(spec)) if i % 2 == 0]
    return tokens, Allocation(exts, locs), rows


@pytest.mark.parametrize("list_max", [0, 10_000], ids=["tensor-path", "list-path"])
# The patched threshold is the same for every example, so sharing the fixture is safe.
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=seqs)
def test_both_build_paths_match_a_per_token_reference(
        monkeypatch: pytest.MonkeyPatch, list_max: int, spec: list[tuple[int, int]]) -> None:
    monkeypatch.setattr(forward_batch, "_LIST_BUILD_MAX_TOKENS", list_max)
    tokens, alloc, rows = _case(spec)
    fb = ForwardBatch.build("prefill", tokens, alloc, rows, torch.device("cpu"), _WIDTH)
    positions, slots, starts, acc = [], [], [], 0
    for e in alloc.extensions:
        starts.append(acc)
        acc += e.new_len
        for j in range(e.new_len):
            positions.append(e.prefix_len + j)
            slots.append(e.slot * _WIDTH + e.prefix_len + j)
    assert fb.input_ids.tolist() == tokens
    assert fb.positions.tolist() == positions
    assert fb.table_index.tolist() == slots
    assert fb.out_cache_loc.tolist() == alloc.out_cache_loc.tolist()
    assert fb.extend_start.tolist() == starts
    assert fb.prefix_lens.tolist() == [e.prefix_len for e in alloc.extensions]
    assert fb.extend_lens.tolist() == [e.new_len for e in alloc.extensions]
    assert fb.seq_lens.tolist() == [e.prefix_len + e.new_len for e in alloc.extensions]
    assert fb.req_pool_indices.tolist() == [e.slot for e in alloc.extensions]
    assert fb.logits_indices.tolist() == [starts[i] + spec[i][1] - 1 for i in rows]
    assert all(t.dtype == torch.int64 for t in (fb.input_ids, fb.positions, fb.table_index))
