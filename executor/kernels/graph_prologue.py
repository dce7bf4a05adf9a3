# mypy: allow-untyped-defs
# (``@triton.jit`` parameters stay unannotated: Triton reads annotations as type hints.)
"""The graph prologue's scatter in one launch (``executor.graphs.prologue``).

A batch packed for a bucket lands in the runner's transfer buffer; before the forward's
graphs, its fields go where the graphs read them: token ids (a decode token that is
``USE_LAST_SAMPLED``, i.e. negative, becomes its sequence's last sampled token), positions,
each new token's location into the request-slot table, and for a captured decode
attention the batch's three decode rows into the backend's static rows. In torch ops that
is six to eight small kernels (compare, gather, where, copy, cast, index_copy, copy); here
one program per ``BLOCK`` tokens does all of it.

Every value is moved, not computed, so the result equals the torch ops' exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 256  # tokens per program: a decode bucket in one program, a prefill in a few


@triton.jit
def _graph_prologue_kernel(
    ids_ptr, pos_ptr, table_index_ptr, loc_ptr, slots_ptr,  # (n,) int64 fields
    last_ptr,  # (max_sequences,) int64 last sampled tokens (LAST)
    ids_out_ptr, pos_out_ptr,  # (n,) int64 graph inputs
    table_ptr,  # flat int32 request-slot table (its last cell the scratch cell)
    rows_ptr, rows_out_ptr,  # (3, n) decode rows and their static copy (ROWS)
    stride_rows, stride_rows_out,
    n,
    LAST: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask = offs < n
    ids = tl.load(ids_ptr + offs, mask=mask)
    if LAST:
        # Only the rows that ask for it read the table of last tokens.
        use_last = ids < 0
        slots = tl.load(slots_ptr + offs, mask=mask & use_last, other=0)
        last = tl.load(last_ptr + slots, mask=mask & use_last, other=0)
        ids = tl.where(use_last, last, ids)
    tl.store(ids_out_ptr + offs, ids, mask=mask)
    tl.store(pos_out_ptr + offs, tl.load(pos_ptr + offs, mask=mask), mask=mask)
    cells = tl.load(table_index_ptr + offs, mask=mask)
    locs = tl.load(loc_ptr + offs, mask=mask)
    tl.store(table_ptr + cells, locs.to(tl.int32), mask=mask)
    if ROWS:
        for r in tl.static_range(3):
            row = tl.load(rows_ptr + r * stride_rows + offs, mask=mask)
            tl.store(rows_out_ptr + r * stride_rows_out + offs,
                     row.to(rows_out_ptr.dtype.element_ty), mask=mask)


def graph_prologue(ids: torch.Tensor, positions: torch.Tensor, table_index: torch.Tensor,
                   locations: torch.Tensor, ids_out: torch.Tensor, positions_out: torch.Tensor,
                   table_flat: torch.Tensor, last: torch.Tensor | None = None,
                   slots: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                   rows_out: torch.Tensor | None = None) -> None:
    """In one launch, for the ``n`` packed tokens (all int64, contiguous, ``n`` long):

    * ``ids_out = where(ids >= 0, ids, last[slots])`` (with ``last``; else ``ids``);
    * ``positions_out = positions``;
    * ``table_flat[table_index] = locations`` (as int32; padding rows name the scratch
      cell, which several may write with the same value);
    * ``rows_out = rows`` (with ``rows``: ``(3, n)`` views, unit stride along ``n``).
    """
    n = ids.shape[0]
    fields = (ids, positions, table_index, locations, ids_out, positions_out)
    assert all(t.shape == (n,) and t.stride(0) == 1 and t.dtype == torch.int64
               for t in fields), "every token field is a contiguous (n,) int64 tensor"
    assert table_flat.dim() == 1 and table_flat.dtype == torch.int32
    with_last = last is not None and slots is not None
    if with_last:
        assert slots is not None and slots.shape == (n,) and slots.stride(0) == 1
    with_rows = rows is not None and rows_out is not None
    if with_rows:
        assert rows is not None and rows_out is not None
        assert rows.shape == rows_out.shape == (3, n)
        assert rows.stride(1) == rows_out.stride(1) == 1
    if n == 0:
        return
    _graph_prologue_kernel[(triton.cdiv(n, BLOCK),)](
        ids, positions, table_index, locations, slots if with_last else ids,
        last if with_last else ids,
        ids_out, positions_out, table_flat,
        rows if with_rows else ids, rows_out if with_rows else ids,
        rows.stride(0) if with_rows else 0,  # type: ignore[union-attr]
        rows_out.stride(0) if with_rows else 0,  # type: ignore[union-attr]
        n,
        LAST=with_last, ROWS=with_rows, BLOCK_T=BLOCK, num_warps=4,
    )
