# mypy: allow-untyped-defs
# (``@triton.jit`` parameters stay unannotated: Triton reads annotations as type hints.)
"""Group the routed (token, slot) pairs by expert, on the device, into fixed-size buffers.

The ``N = T * top_k`` pairs are numbered ``t * top_k + j``. ``sorted_ids`` lists them
expert by expert (ascending within an expert), each expert's run padded with ``N`` up to
a multiple of ``block_m``; ``block_experts[b]`` is the expert of rows
``b * block_m : (b + 1) * block_m`` (-1 past the end); ``num_padded`` is the number of rows
used. The buffers are sized for the worst case of ``T`` (``max_padded_rows``), so a CUDA
graph captures the step and nothing is read back to the host.

One program does it all (count, padded prefix sum, scatter): ``N`` is at most a prefill's
tokens times ``top_k``, read twice in chunks, while the experts' GEMMs read megabytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def align_body(
    ids_ptr,  # (N,) int32 expert of each (token, slot)
    sorted_ptr,  # (max_rows,) int32 out
    block_expert_ptr,  # (max_blocks,) int32 out
    num_padded_ptr,  # (1,) int32 out
    n, max_rows, max_blocks,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    E_POW2: tl.constexpr,  # >= the number of experts, a power of two
):
    """The whole alignment, by one program (``_align_kernel``, ``route_align``)."""
    experts = tl.arange(0, E_POW2)
    chunk = tl.arange(0, CHUNK)
    # 1. tokens per expert
    counts = tl.zeros([E_POW2], dtype=tl.int32)
    for start in range(0, n, CHUNK):
        offs = start + chunk
        ids = tl.load(ids_ptr + offs, mask=offs < n, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)  # (E_POW2,) end row of each expert's run
    total = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, total)
    # 2. the expert of each block of rows (an expert with no token has an empty run)
    for start in range(0, max_blocks, CHUNK):
        blocks = start + chunk
        rows = blocks * BLOCK_M
        expert = tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, tl.where(rows < total, expert, -1),
                 mask=blocks < max_blocks)
    # 3. padding everywhere, then each pair at its expert's next free row
    for start in range(0, max_rows, CHUNK):
        offs = start + chunk
        tl.store(sorted_ptr + offs, tl.zeros([CHUNK], dtype=tl.int32) + n, mask=offs < max_rows)
    tl.debug_barrier()  # the scatter below overwrites padding other threads stored
    next_row = ends - padded  # (E_POW2,)
    for start in range(0, n, CHUNK):
        offs = start + chunk
        ids = tl.load(ids_ptr + offs, mask=offs < n, other=-1)
        hit = (ids[:, None] == experts[None, :]).to(tl.int32)  # (CHUNK, E_POW2)
        before = tl.cumsum(hit, axis=0) - hit  # pairs of the same expert earlier in the chunk
        row = tl.sum(hit * (next_row[None, :] + before), axis=1)
        tl.store(sorted_ptr + row, offs, mask=offs < n)
        next_row += tl.sum(hit, axis=0)


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, n, max_rows,
                  max_blocks, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                  E_POW2: tl.constexpr):
    align_body(ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, n, max_rows, max_blocks,
               BLOCK_M, CHUNK, E_POW2)


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows the padded runs can take at most: every pair, plus up to ``block_m - 1``
    padding rows for each expert that can receive a pair, rounded up to whole blocks."""
    rows = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    return triton.cdiv(rows, block_m) * block_m


Aligned = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # sorted, block experts, rows


def empty_aligned(num_pairs: int, num_experts: int, block_m: int, device: torch.device
                  ) -> Aligned:
    """The alignment's buffers for ``num_pairs`` pairs (uninitialized)."""
    max_rows = max_padded_rows(num_pairs, num_experts, block_m)
    return (torch.empty(max_rows, dtype=torch.int32, device=device),
            torch.empty(max_rows // block_m, dtype=torch.int32, device=device),
            torch.empty(1, dtype=torch.int32, device=device))


def chunk_for(num_experts: int) -> int:
    """Pairs per step of the alignment's loops: a ``(CHUNK, E)`` one-hot in registers."""
    return max(16, min(256, 8192 // triton.next_power_of_2(num_experts)))


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> Aligned:
    """``(sorted_ids, block_experts, num_padded)`` for ``ids`` ``(T, top_k)`` int32 (see the
    module docstring); sizes depend only on ``T``, ``top_k``, the experts and ``block_m``."""
    flat = ids.reshape(-1)
    n = flat.numel()
    sorted_ids, block_experts, num_padded = empty_aligned(n, num_experts, block_m, ids.device)
    _align_kernel[(1,)](flat, sorted_ids, block_experts, num_padded, n, sorted_ids.numel(),
                        block_experts.numel(), BLOCK_M=block_m, CHUNK=chunk_for(num_experts),
                        E_POW2=triton.next_power_of_2(num_experts), num_warps=8)
    return sorted_ids, block_experts, num_padded
