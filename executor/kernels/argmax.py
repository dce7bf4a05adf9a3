# mypy: allow-untyped-defs
# (``@triton.jit`` parameters stay unannotated: Triton reads annotations as type hints.)
"""Row-wise argmax over a vocabulary, spread across the GPU: greedy sampling's one kernel.

``torch.argmax(dim=-1)`` reduces a row in one thread block, so a batch of a few rows keeps
a handful of SMs busy. Here each row is cut into chunks of ``block`` columns, one program
per (row, chunk) finds the chunk's maximum and the first column holding it, and a second
launch picks the first chunk holding the row's maximum: the result is torch's (the first
index of the maximum), for rows without NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from executor.kernels.fast_launch import FastLauncher, cdiv, next_power_of_2
from executor.kernels.pdl import pdl_enter

BLOCK = 2048  # columns per program of the first pass: 16 float32 per thread with 4 warps


@triton.jit
def _chunk_argmax_kernel(x_ptr, val_ptr, idx_ptr, n_cols, stride_x, n_chunks,
                         BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < n_cols, other=float("-inf"))
    x = x.to(tl.float32)
    # Masked lanes sit after every real column, so ties resolve to a real one.
    best_val, best = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(val_ptr + row * n_chunks + chunk, best_val)
    tl.store(idx_ptr + row * n_chunks + chunk, chunk * BLOCK_N + best)


@triton.jit
def _pick_chunk_kernel(val_ptr, idx_ptr, out_ptr, slots_ptr, table_ptr, mark_ptr, skip,
                       n_chunks, CHUNKS: tl.constexpr, STORE: tl.constexpr,
                       MARKED: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CHUNKS)
    mask = offs < n_chunks
    vals = tl.load(val_ptr + row * n_chunks + offs, mask=mask, other=float("-inf"))
    _, first = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
    token = tl.load(idx_ptr + row * n_chunks + first).to(tl.int64)
    tl.store(out_ptr + row, token)
    if STORE:
        if MARKED:  # a row marked ``skip`` (a graph bucket's padding) stores nothing
            keep = tl.load(mark_ptr + row) != skip
            tl.store(table_ptr + tl.load(slots_ptr + row, mask=keep, other=0), token,
                     mask=keep)
        else:
            tl.store(table_ptr + tl.load(slots_ptr + row), token)


def argmax_rows(x: torch.Tensor, block: int = BLOCK,
                store: tuple[torch.Tensor, torch.Tensor] | None = None,
                out: torch.Tensor | None = None,
                padding: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for a 2-D ``x`` with unit column stride: ``(rows,)`` int64,
    into ``out`` if given (a contiguous ``(rows,)`` int64 tensor, e.g. a graph's buffer).

    With ``store = (table, slots)`` (int64, ``slots`` one per row), the second launch also
    writes ``table[slots[r]] = argmax of row r``: a decode step's greedy tokens become its
    sequences' last sampled tokens without an ``index_copy_`` launch after it. With
    ``padding = (marks, value)`` (``marks`` int64, one per row), rows whose mark is
    ``value`` store nothing (a graph bucket's padded rows, whose slot is a placeholder)."""
    assert x.dim() == 2 and x.stride(-1) == 1, "x must be (rows, cols) with contiguous rows"
    rows, cols = x.shape
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=x.device)
    assert out.shape == (rows,) and out.dtype == torch.int64 and out.stride(0) == 1
    if store is not None:
        table, slots = store
        assert table.dtype == slots.dtype == torch.int64 and table.dim() == 1
        assert slots.shape == (rows,) and slots.stride(0) == 1 and table.stride(0) == 1
    if padding is not None:
        assert store is not None, "padding marks only rows that store"
        assert padding[0].dtype == torch.int64 and padding[0].shape[0] >= rows \
            and padding[0].stride(0) == 1
    if rows == 0:
        return out
    if cols == 0:
        raise ValueError("argmax of an empty row")
    n_chunks = cdiv(cols, block)
    vals = torch.empty((rows, n_chunks), dtype=torch.float32, device=x.device)
    idx = torch.empty((rows, n_chunks), dtype=torch.int32, device=x.device)
    # Keys: what the JIT specializes on besides pointer alignment (dtypes, integer
    # arguments); see executor.kernels.fast_launch. A decode step calls this once per step.
    _CHUNK.launch((rows, n_chunks, 1), (x.dtype, cols, x.stride(0), n_chunks, block),
                  (x, vals, idx, cols, x.stride(0), n_chunks), {"BLOCK_N": block})
    table, slots = store if store is not None else (out, out)
    marks, skip = padding if padding is not None else (out, 0)
    _PICK.launch((rows, 1, 1), (n_chunks, store is not None, padding is not None, skip),
                 (vals, idx, out, slots, table, marks, skip, n_chunks),
                 {"CHUNKS": next_power_of_2(n_chunks), "STORE": store is not None,
                  "MARKED": padding is not None})
    return out


_CHUNK = FastLauncher(_chunk_argmax_kernel, pdl=True, num_warps=4)
_PICK = FastLauncher(_pick_chunk_kernel, pdl=True, num_warps=1)
