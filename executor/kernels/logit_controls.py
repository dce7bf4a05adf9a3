# mypy: allow-untyped-defs
# (``@triton.jit`` parameters stay unannotated: Triton reads annotations as type hints.)
"""Token mask and logit bias applied to logits rows in place, by each row's slot.

One program per (row, chunk of ``BLOCK`` columns): it reads its row's slot and that slot's
``active`` flag and returns at once when the slot has no controls (an unmasked batch costs
one launch of idle programs). Otherwise it sets the chunk's disallowed columns to -inf,
then adds the slot's bias entries whose ids fall in its chunk (after a barrier: the same
program wrote those columns, so no other program races on them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # columns per program (32 mask words)


@triton.jit
def _controls_kernel(x_ptr, slots_ptr, active_ptr, allowed_ptr, bias_ids_ptr, bias_vals_ptr,
                     n_cols, stride_x, n_words, n_bias, n_slots,
                     BLOCK_N: tl.constexpr, BIAS_P2: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    # A slot outside the tables (a graph warmed up before its inputs were written) has no
    # controls: never read past the tables.
    inside_tables = (slot >= 0) & (slot < n_slots)
    if tl.load(active_ptr + slot, mask=inside_tables, other=0) != 0:
        cols = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
        inside = cols < n_cols
        words = tl.load(allowed_ptr + slot * n_words + cols // 32, mask=inside, other=-1)
        keep = ((words >> (cols % 32)) & 1) != 0
        x_row = x_ptr + row * stride_x
        x = tl.load(x_row + cols, mask=inside, other=0.0)
        x = tl.where(keep, x, float("-inf"))
        tl.store(x_row + cols, x.to(x_row.dtype.element_ty), mask=inside)
        tl.debug_barrier()
        k = tl.arange(0, BIAS_P2)
        ids = tl.load(bias_ids_ptr + slot * n_bias + k, mask=k < n_bias, other=-1)
        vals = tl.load(bias_vals_ptr + slot * n_bias + k, mask=k < n_bias, other=0.0)
        mine = (ids >= chunk * BLOCK_N) & (ids < chunk * BLOCK_N + BLOCK_N) & (ids < n_cols) \
            & (vals != 0.0)
        old = tl.load(x_row + ids, mask=mine, other=0.0)
        new = old.to(tl.float32) + vals
        tl.store(x_row + ids, new.to(x_row.dtype.element_ty), mask=mine)


def apply_controls(logits: torch.Tensor, slots: torch.Tensor, active: torch.Tensor,
                   allowed: torch.Tensor, bias_ids: torch.Tensor, bias_vals: torch.Tensor,
                   block: int = BLOCK) -> None:
    """``logits`` (rows, vocab), unit column stride, modified in place; ``slots`` (rows,)
    int64; the tables as ``SlotControls`` holds them. Capturable (no host sync)."""
    rows, vocab = logits.shape
    if rows == 0:
        return
    n_bias = bias_ids.shape[1]
    grid = (rows, triton.cdiv(vocab, block))
    _controls_kernel[grid](logits, slots, active, allowed, bias_ids, bias_vals, vocab,
                           logits.stride(0), allowed.shape[1], n_bias, active.shape[0],
                           BLOCK_N=block,
                           BIAS_P2=triton.next_power_of_2(n_bias))
