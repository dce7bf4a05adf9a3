# mypy: allow-untyped-defs
# (``@triton.jit`` parameters stay unannotated: Triton reads annotations as type hints.)
"""Split-KV decode's splits: where each split's positions lie (``_split_size``,
``_window_start``), and the split kernel's in-kernel merge: the last split of a
(sequence, KV head) to finish merges every split's partial output, so no reduction
kernel is launched.

Each split program stores its partials, then counts itself done on a per-(sequence, KV
head) counter (an atomic with release/acquire semantics); the program that brings the
count to ``num_splits`` reads the partials back (past L1) and writes the output, then
resets the counter for the next launch. The merge sums the splits in index order, so the
result does not depend on which program is last. The counters (``split_counters``) are
one zeroed int32 buffer per device, allocated at the first eager launch that wants them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Rows x KV heads of a launch up to which the split kernel merges its splits itself (the
#: counters' size): beyond, a launch has at most a couple of splits per sequence anyway.
MAX_MERGED_PROGRAM_ROWS = 1024
_COUNTERS: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _split_size(cached, num_splits, ALIGN: tl.constexpr):
    # ceil(cached / num_splits) rounded up to a multiple of ALIGN (ALIGN when cached == 0).
    per_split = (cached + num_splits - 1) // num_splits
    return tl.maximum((per_split + ALIGN - 1) // ALIGN * ALIGN, ALIGN)


@triton.jit
def _window_start(cached, window, SLIDING: tl.constexpr):
    """The first cached position the query at position ``cached`` sees: 0, or with a
    window the first of ``(cached - window, cached]``."""
    if SLIDING:
        return tl.maximum(cached - window + 1, 0)
    return cached * 0


def split_counters(device: torch.device, rows: int) -> torch.Tensor | None:
    """The zeroed (``MAX_MERGED_PROGRAM_ROWS``,) int32 counters of ``device`` for a launch
    of ``rows`` (sequence, KV head) pairs, or None: more rows than that, or a first use
    under CUDA-graph capture (the buffer must outlive any one graph's memory pool, so it
    is allocated eagerly; warm-up runs each launch before its capture)."""
    if rows > MAX_MERGED_PROGRAM_ROWS:
        return None
    counters = _COUNTERS.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = _COUNTERS[device] = torch.zeros(MAX_MERGED_PROGRAM_ROWS,
                                                   dtype=torch.int32, device=device)
    return counters


@triton.jit
def merge_if_last(counter_ptr, mid_o_ptr, mid_lse_ptr, out_ptr, b, kvh, group, offs_d, mask_d,
                  shared, chunk, num_splits, stride_mid_b, stride_mid_h, stride_mid_s,
                  stride_lse_b, stride_lse_h, stride_out_t, stride_out_h,
                  BLOCK_S: tl.constexpr):
    """Count this split done; the last of its (sequence, KV head) merges, head by head of
    the ``group``, the splits that ran (split 0 and those that start before the
    ``shared`` visible positions end, as the reduction kernel reads them) into ``out``:
    the reduction kernel's log-sum-exp weighted mean, each head's partials loaded at
    once."""
    # NOTE: every thread's partial stores must precede the count (the barrier), and the
    # count must publish them to the other programs (release) and make theirs visible to
    # the last one (acquire); the merge's loads bypass L1, which is not coherent.
    tl.debug_barrier()
    counter = counter_ptr + b * tl.num_programs(1) + kvh
    done = tl.atomic_add(counter, 1, sem="acq_rel")
    if done == num_splits - 1:
        ran = tl.minimum(tl.maximum((shared + chunk - 1) // chunk, 1), num_splits)
        offs_s = tl.arange(0, BLOCK_S)
        mask_s = offs_s < ran
        for i in range(0, group):
            h = kvh * group + i
            lse = tl.load(mid_lse_ptr + b * stride_lse_b + h * stride_lse_h + offs_s,
                          mask=mask_s, other=float("-inf"), cache_modifier=".cg")
            ran_s = lse > float("-inf")  # split 0 always ran: the max is finite
            weight = tl.where(ran_s, tl.exp2(lse - tl.max(lse, axis=0)), 0.0)  # (BLOCK_S,)
            mid = tl.load(mid_o_ptr + b * stride_mid_b + h * stride_mid_h
                          + offs_s[:, None] * stride_mid_s + offs_d[None, :],
                          mask=mask_s[:, None] & mask_d[None, :], other=0.0,
                          cache_modifier=".cg")  # (BLOCK_S, BLOCK_D)
            mid = tl.where(ran_s[:, None], mid, 0.0)  # an idle split's: never written
            out = tl.sum(mid * weight[:, None], axis=0) / tl.sum(weight, axis=0)
            tl.store(out_ptr + b * stride_out_t + h * stride_out_h + offs_d,
                     out.to(out_ptr.dtype.element_ty), mask=mask_d)
        tl.store(counter, 0)  # ready for the next launch
