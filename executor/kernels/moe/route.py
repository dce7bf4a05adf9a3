# mypy: allow-untyped-defs
# (``@triton.jit`` parameters stay unannotated: Triton reads annotations as type hints.)
"""Router softmax and top-k in one kernel: what ``reference.route`` does in five torch ops.

Each program takes a block of tokens' router logits ``(BLOCK_T, E)``, picks the ``top_k``
largest one after the other (descending, the lowest expert index first among equal logits;
softmax keeps their order, and ``torch.topk``'s order among equals is its own), takes
their probabilities as the float32 softmax gives them, divides those by their sum with
``RENORMALIZE`` and rounds them through the logits' dtype with ``ROUND_TO_ACT``
(Qwen3-MoE). Outputs: float32 weights and int32 ids, ``(T, top_k)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from executor.kernels.moe.align import Aligned, align, align_body, chunk_for, empty_aligned


@triton.jit
def topk_rows(
    logits_ptr,  # (T, E)
    rows,  # (BLOCK_T,) token indices (those past ``num_tokens`` read zeros)
    num_tokens, num_experts, stride_l,
    TOP_K: tl.constexpr,
    E_POW2: tl.constexpr,
    K_POW2: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ROUND_TO_ACT: tl.constexpr,
):
    """``(weights, ids)`` ``(BLOCK_T, K_POW2)`` float32 and int32 of the tokens ``rows``
    (slots past ``TOP_K`` hold zeros): the routing, in registers."""
    cols = tl.arange(0, E_POW2)
    row_ok = rows < num_tokens
    col_ok = cols < num_experts
    mask = row_ok[:, None] & col_ok[None, :]
    # rows past the end read zeros (no NaN from -inf - -inf); columns past E are -inf
    raw = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_l + cols[None, :],
                  mask=mask, other=0.0)
    # One reduction per pick, on integer keys: a logit's bits in signed order (softmax
    # keeps its order) above its reversed expert index, so the maximum key is the largest
    # logit and, among equals, the lowest index; 0 marks a column out of the race. 16-bit
    # logits make 32-bit keys: each pick is one warp-wide integer max.
    tl.static_assert(raw.dtype.primitive_bitwidth != 16 or E_POW2 <= 32768)
    key = _order_key(raw) * E_POW2 + (E_POW2 - 1 - cols[None, :])
    key = tl.where(col_ok[None, :], key, 0)
    slots = tl.arange(0, K_POW2)
    top_l = tl.zeros((rows.shape[0], K_POW2), dtype=tl.float32)
    top_i = tl.zeros((rows.shape[0], K_POW2), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(key, axis=1)  # (BLOCK_T,)
        idx = (E_POW2 - 1 - best % E_POW2).to(tl.int32)
        top_l = tl.where(slots[None, :] == j, _key_logit(best // E_POW2, raw.dtype)[:, None],
                         top_l)
        top_i = tl.where(slots[None, :] == j, idx[:, None], top_i)
        key = tl.where(cols[None, :] == idx[:, None], 0, key)
    # Then their probabilities, exp(x - max) / sum as the torch ops take them in float32
    # (after the picks: the experts are known without waiting for the softmax's sums)
    x = tl.where(col_ok[None, :], raw.to(tl.float32), float("-inf"))
    m = tl.max(x, axis=1)[:, None]
    total = tl.sum(tl.where(col_ok[None, :], tl.exp(x - m), 0.0), axis=1)[:, None]
    top_w = tl.where(slots[None, :] < TOP_K, tl.exp(top_l - m) / total, 0.0)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=1)[:, None]
    if ROUND_TO_ACT:
        top_w = top_w.to(logits_ptr.dtype.element_ty).to(tl.float32)
    return top_w, top_i


@triton.jit
def _order_key(raw):
    """Logits (16- or 32-bit floats) as positive integers in the same order (-0 equal to
    0; a NaN above +inf, or below -inf with its sign bit set): below 2^16 in int32 for
    16-bit logits (room above for 2^15 index values), below 2^32 in int64 for float32."""
    if raw.dtype.primitive_bitwidth == 16:
        bits = raw.to(tl.int16, bitcast=True).to(tl.int32)
        ordered = tl.where(bits < 0, -(bits & 0x7FFF), bits) + 0x8000
    else:
        wide = raw.to(tl.int32, bitcast=True).to(tl.int64)
        ordered = tl.where(wide < 0, -(wide & 0x7FFFFFFF), wide) + 0x7FFFFFFF + 1
    return ordered


@triton.jit
def _key_logit(ordered, dtype: tl.constexpr):
    """The float32 value of the logit ``_order_key`` made ``ordered``."""
    if dtype.primitive_bitwidth == 16:
        v = ordered - 0x8000
        half = tl.where(v < 0, (-v) | 0x8000, v).to(tl.int16)
        logit = half.to(dtype, bitcast=True).to(tl.float32)
    else:
        w = ordered - 0x7FFFFFFF - 1
        bits = tl.where(w < 0, (-w).to(tl.int32) | -2147483648, w.to(tl.int32))
        logit = bits.to(tl.float32, bitcast=True)
    return logit


@triton.jit
def route_rows(
    logits_ptr,  # (T, E)
    weights_ptr,  # (T, TOP_K) float32 out
    ids_ptr,  # (T, TOP_K) int32 out
    rows,  # (BLOCK_T,) token indices of this block
    num_tokens, num_experts, stride_l,
    TOP_K: tl.constexpr,
    E_POW2: tl.constexpr,
    K_POW2: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ROUND_TO_ACT: tl.constexpr,
):
    """Route the tokens ``rows`` (those past ``num_tokens`` are skipped)."""
    top_w, top_i = topk_rows(logits_ptr, rows, num_tokens, num_experts, stride_l, TOP_K,
                             E_POW2, K_POW2, RENORMALIZE, ROUND_TO_ACT)
    slots = tl.arange(0, K_POW2)
    out_mask = (rows < num_tokens)[:, None] & (slots[None, :] < TOP_K)
    offs = rows[:, None].to(tl.int64) * TOP_K + slots[None, :]
    tl.store(weights_ptr + offs, top_w, mask=out_mask)
    tl.store(ids_ptr + offs, top_i, mask=out_mask)


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, stride_l,
                  TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, E_POW2: tl.constexpr,
                  K_POW2: tl.constexpr, RENORMALIZE: tl.constexpr, ROUND_TO_ACT: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    route_rows(logits_ptr, weights_ptr, ids_ptr, rows, num_tokens, num_experts, stride_l,
               TOP_K, E_POW2, K_POW2, RENORMALIZE, ROUND_TO_ACT)


@triton.jit
def _route_align_kernel(logits_ptr, weights_ptr, ids_ptr, sorted_ptr, block_expert_ptr,
                        num_padded_ptr, num_tokens, num_experts, stride_l, max_rows,
                        max_blocks, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr,
                        E_POW2: tl.constexpr, K_POW2: tl.constexpr,
                        RENORMALIZE: tl.constexpr, ROUND_TO_ACT: tl.constexpr,
                        BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    # one program: every token routed, then (its ids read back) aligned
    for start in range(0, num_tokens, BLOCK_T):
        route_rows(logits_ptr, weights_ptr, ids_ptr, start + tl.arange(0, BLOCK_T),
                   num_tokens, num_experts, stride_l, TOP_K, E_POW2, K_POW2, RENORMALIZE,
                   ROUND_TO_ACT)
    tl.debug_barrier()  # the ids other threads stored, visible to the whole program
    align_body(ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_tokens * TOP_K,
               max_rows, max_blocks, BLOCK_M, CHUNK, E_POW2)


def route_topk(logits: torch.Tensor, top_k: int, renormalize: bool,
               weights_in_activation_dtype: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.route`` in one launch: ``(weights float32, ids int32)``, ``(T, top_k)``."""
    t, experts = logits.shape
    assert logits.stride(-1) == 1
    weights = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=logits.device)
    if t == 0:
        return weights, ids
    e_pow2 = triton.next_power_of_2(experts)
    block_t = _block_t(e_pow2)
    _route_kernel[(triton.cdiv(t, block_t),)](
        logits, weights, ids, t, experts, logits.stride(0), TOP_K=top_k, BLOCK_T=block_t,
        E_POW2=e_pow2, K_POW2=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
        ROUND_TO_ACT=weights_in_activation_dtype, num_warps=4)
    return weights, ids


#: Up to this many tokens (decode batches) routing and alignment are one launch: one
#: program routes them all, then aligns; past it the routing's parallelism wins.
ROUTE_ALIGN_MAX_TOKENS = 64


def _block_t(e_pow2: int) -> int:
    return max(1, min(16, 4096 // e_pow2))


def route_align(logits: torch.Tensor, top_k: int, renormalize: bool,
                weights_in_activation_dtype: bool, block_m: int
                ) -> tuple[torch.Tensor, torch.Tensor, Aligned]:
    """``route_topk`` then ``align.align`` of its ids: ``(weights, ids, aligned)``; one
    launch up to ``ROUTE_ALIGN_MAX_TOKENS`` tokens, two past it."""
    t, experts = logits.shape
    if t > ROUTE_ALIGN_MAX_TOKENS:
        weights, ids = route_topk(logits, top_k, renormalize, weights_in_activation_dtype)
        return weights, ids, align(ids, experts, block_m)
    assert logits.stride(-1) == 1
    weights = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=logits.device)
    aligned = empty_aligned(t * top_k, experts, block_m, logits.device)
    e_pow2 = triton.next_power_of_2(experts)
    _route_align_kernel[(1,)](
        logits, weights, ids, *aligned, t, experts, logits.stride(0), aligned[0].numel(),
        aligned[1].numel(), TOP_K=top_k, BLOCK_T=_block_t(e_pow2), E_POW2=e_pow2,
        K_POW2=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
        ROUND_TO_ACT=weights_in_activation_dtype, BLOCK_M=block_m, CHUNK=chunk_for(experts),
        num_warps=8)
    return weights, ids, aligned
