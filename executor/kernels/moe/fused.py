# mypy: allow-untyped-defs
# (``@triton.jit`` parameters stay unannotated: Triton reads annotations as type hints.)
"""The experts as two grouped GEMMs over the rows ``align`` grouped by expert.

``gate_up``: one launch over (row block, column block) programs; each program reads its
block's expert from ``block_experts``, gathers its tokens' rows of ``x``, and computes the
same columns of gate and of up, so SiLU-and-mul is fused and only ``(N, I)`` activations
are written (rows by pair ``t * top_k + j``). ``down``: one launch, the activations times
the expert's down weights, each row scaled by its routing weight and written at its pair's
row of ``(N, H)``; ``fused_experts`` then sums each token's ``top_k`` rows (a few tokens
take ``decode``'s two launches instead, the sum in the down kernel). Programs past
``num_padded`` return at once, so grids are fixed by ``T`` (capturable) and experts that
received no token cost nothing. Rounding follows the eager reference: each GEMM's output
in the activation dtype, SiLU in float32 rounded, the product rounded, the routing weight
applied in float32 and rounded. FP8 weights (``scales``) enter ``tl.dot`` converted to the
activation dtype, scaled per output column at the end or per block on each chunk's sums.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from executor.kernels.moe import decode, scales
from executor.kernels.moe import route as routing
from executor.kernels.moe.align import Aligned, align
from executor.kernels.moe.decode_parts import gate_up_scale_ptrs


@triton.jit
def _gate_up_kernel(
    x_ptr,  # (T, K) activations
    w_ptr,  # (E, 2 * N, K): gate rows [0, N), up rows [N, 2N); e4m3 with W_SCALES
    s_ptr,  # W_SCALES 1: (E, 2 * N) float32; 2: (E, 2 * N / SB, cdiv(K, SB))
    out_ptr,  # (T * top_k, N)
    sorted_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, n_cols, k_dim, top_k,
    stride_xm, stride_we, stride_wn, stride_om, stride_se, stride_sr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    W_SCALES: tl.constexpr, SB: tl.constexpr,  # scales.NONE/CHANNEL/BLOCKS, block size
):
    pid = tl.program_id(0)
    col_blocks = tl.cdiv(n_cols, BLOCK_N)
    pid_m, pid_n = pid // col_blocks, pid % col_blocks
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # (BLOCK_M,)
    valid = pair < num_pairs
    token = (pair // top_k).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * stride_xm + ks[None, :]
    g_ptrs = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    u_ptrs = g_ptrs + n_cols * stride_wn
    sg_ptrs, su_ptrs = gate_up_scale_ptrs(s_ptr, expert, stride_se, stride_sr, cols, n_cols,
                                          W_SCALES, SB)
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, k_dim, BLOCK_K):
        k_ok = ks + k < k_dim
        a = tl.load(a_ptrs + k, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        if W_SCALES == 0:
            gate = tl.dot(a, tl.load(g_ptrs + k, mask=w_mask, other=0.0), gate,
                          input_precision=PRECISION)
            up = tl.dot(a, tl.load(u_ptrs + k, mask=w_mask, other=0.0), up,
                        input_precision=PRECISION)
        elif W_SCALES == 1:  # e4m3 to the activation dtype (exact), row scales at the end
            g_w = tl.load(g_ptrs + k, mask=w_mask, other=0.0).to(a.dtype)
            u_w = tl.load(u_ptrs + k, mask=w_mask, other=0.0).to(a.dtype)
            gate = tl.dot(a, g_w, gate, input_precision=PRECISION)
            up = tl.dot(a, u_w, up, input_precision=PRECISION)
        else:  # each chunk's sums times its block's scale
            g_w = tl.load(g_ptrs + k, mask=w_mask, other=0.0).to(a.dtype)
            u_w = tl.load(u_ptrs + k, mask=w_mask, other=0.0).to(a.dtype)
            sg = tl.load(sg_ptrs + k // SB, mask=col_ok, other=0.0)
            su = tl.load(su_ptrs + k // SB, mask=col_ok, other=0.0)
            gate += tl.dot(a, g_w, input_precision=PRECISION) * sg[None, :]
            up += tl.dot(a, u_w, input_precision=PRECISION) * su[None, :]
    if W_SCALES == 1:
        gate = gate * tl.load(sg_ptrs, mask=col_ok, other=0.0)[None, :]
        up = up * tl.load(su_ptrs, mask=col_ok, other=0.0)[None, :]
    act_ty = out_ptr.dtype.element_ty
    g = gate.to(act_ty).to(tl.float32)
    u = up.to(act_ty).to(tl.float32)
    act = tl.div_rn(g, 1.0 + tl.exp(-g)).to(act_ty).to(tl.float32) * u
    dst = out_ptr + pair[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(dst, act.to(act_ty), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    a_ptr,  # (T * top_k, K) activations, by pair
    w_ptr,  # (E, N, K); e4m3 with W_SCALES
    s_ptr,  # W_SCALES 1: (E, N) float32; 2: (E, cdiv(N, SB), K / SB)
    out_ptr,  # (T * top_k, N)
    weight_ptr,  # (T * top_k,) float32 routing weights
    sorted_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, n_cols, k_dim,
    stride_am, stride_we, stride_wn, stride_om, stride_se, stride_sr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    W_SCALES: tl.constexpr, SB: tl.constexpr,
):
    pid = tl.program_id(0)
    col_blocks = tl.cdiv(n_cols, BLOCK_N)
    pid_m, pid_n = pid // col_blocks, pid % col_blocks
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < num_pairs
    row = pair.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + row[:, None] * stride_am + ks[None, :]
    w_ptrs = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    if W_SCALES == 2:
        s_ptrs = s_ptr + expert * stride_se + (cols // SB) * stride_sr
    else:
        s_ptrs = s_ptr + expert * stride_se + cols
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, k_dim, BLOCK_K):
        k_ok = ks + k < k_dim
        a = tl.load(a_ptrs + k, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs + k, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if W_SCALES == 0:
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
        elif W_SCALES == 1:
            acc = tl.dot(a, w.to(a.dtype), acc, input_precision=PRECISION)
        else:
            s = tl.load(s_ptrs + k // SB, mask=col_ok, other=0.0)
            acc += tl.dot(a, w.to(a.dtype), input_precision=PRECISION) * s[None, :]
    if W_SCALES == 1:
        acc = acc * tl.load(s_ptrs, mask=col_ok, other=0.0)[None, :]
    act_ty = out_ptr.dtype.element_ty
    scale = tl.load(weight_ptr + row, mask=valid, other=0.0)
    y = acc.to(act_ty).to(tl.float32) * scale[:, None]
    dst = out_ptr + row[:, None] * stride_om + cols[None, :]
    tl.store(dst, y.to(act_ty), mask=valid[:, None] & col_ok[None, :])


@dataclass(frozen=True)
class MoeTiles:
    """Tile sizes of the two GEMMs (``block_m`` is also ``align``'s padding);
    ``block_n_down`` defaults to ``block_n``."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    block_n_down: int | None = None


@functools.lru_cache(maxsize=8)
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _narrow_enough(row_blocks: int, cols: int, widest: int, sms: int) -> int:
    """The widest column block (down to 16) that still gives every multiprocessor a
    program: at decode the few row blocks alone would leave most of the GPU idle while
    the weights stream."""
    block = widest
    while block > 16 and row_blocks * triton.cdiv(cols, block) < sms:
        block //= 2
    return block


def pick_tiles(num_pairs: int, num_experts: int, dtype: torch.dtype, inter: int = 0,
               hidden: int = 0, device: torch.device | None = None) -> MoeTiles:
    """Tiles by the mean rows per expert: 16-row blocks while an expert sees a few rows
    (decode: each block is padding around a handful of tokens, the GEMM streams weights,
    column blocks narrowed until the GPU is covered), taller ones once experts see many
    (prefill: the GEMMs are compute-bound)."""
    per_expert = num_pairs / num_experts
    block_k = 32 if dtype == torch.float32 else 64
    if per_expert > 64:
        return MoeTiles(64, 128, block_k, num_warps=8)
    if per_expert > 16:
        return MoeTiles(32, 64, block_k)
    sms = _multiprocessors(device) if device is not None else 1
    blocks = min(num_pairs, num_experts)  # row blocks that hold pairs, at most
    return MoeTiles(16, _narrow_enough(blocks, inter, 64, sms),
                    block_k if dtype == torch.float32 else 2 * block_k,
                    block_n_down=_narrow_enough(blocks, hidden, 64, sms))


def fused_experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                  weights: torch.Tensor, ids: torch.Tensor, tiles: MoeTiles | None = None, *,
                  w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                  block: tuple[int, int] | None = None) -> torch.Tensor:
    """What ``reference.experts_reference`` computes, as align + two grouped GEMMs + a sum:
    ``x`` ``(T, H)``, ``w_gate_up`` ``(E, 2I, H)``, ``w_down`` ``(E, H, I)``, ``weights``
    float32 and ``ids`` int32, both ``(T, top_k)``; with ``w13_scale`` / ``w2_scale`` the
    weights are e4m3 (``scales``). No host sync; a new ``(T, H)`` tensor."""
    scales.check_pair(w_gate_up, w_down, w13_scale, w2_scale, block)
    if ids.numel() == 0:
        return torch.zeros_like(x)
    tiles = tiles or _tiles(x, w_gate_up, ids.numel())
    return grouped_experts(x, w_gate_up, w_down, weights, ids.shape[1],
                           align(ids, w_gate_up.shape[0], tiles.block_m), tiles,
                           w13_scale=w13_scale, w2_scale=w2_scale, block=block)


def _tiles(x: torch.Tensor, w_gate_up: torch.Tensor, num_pairs: int) -> MoeTiles:
    experts, two_i, hidden = w_gate_up.shape
    return pick_tiles(num_pairs, experts, x.dtype, two_i // 2, hidden, x.device)


def grouped_experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                    weights: torch.Tensor, top_k: int, aligned: Aligned, tiles: MoeTiles, *,
                    w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                    block: tuple[int, int] | None = None) -> torch.Tensor:
    """The two grouped GEMMs and the sum, over pairs ``aligned`` with ``tiles.block_m``;
    e4m3 weights with their scales (``scales``) go to the tensor cores in the activation
    dtype (w8a16: the weight read is halved, the GEMM is the bf16 one)."""
    t, hidden = x.shape
    inter = w_gate_up.shape[1] // 2
    num_pairs = t * top_k
    assert x.stride(-1) == 1 and w_gate_up.stride(-1) == 1 and w_down.stride(-1) == 1
    s13, s2 = scales.check_pair(w_gate_up, w_down, w13_scale, w2_scale, block)
    assert s13.mode != scales.BLOCKS or scales.BLOCK % tiles.block_k == 0, \
        "block scales: reduction chunks inside one block column"
    block_n_down = tiles.block_n_down or tiles.block_n
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    sorted_ids, block_experts, num_padded = aligned
    blocks = block_experts.numel()
    act = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    _gate_up_kernel[(blocks * triton.cdiv(inter, tiles.block_n),)](
        x, w_gate_up, s13.scale, act, sorted_ids, block_experts, num_padded,
        num_pairs, inter, hidden, top_k,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), act.stride(0),
        s13.stride_e, s13.stride_r,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        PRECISION=precision, W_SCALES=s13.mode, SB=scales.BLOCK,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    out = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    _down_kernel[(blocks * triton.cdiv(hidden, block_n_down),)](
        act, w_down, s2.scale, out, weights.reshape(-1).to(torch.float32), sorted_ids,
        block_experts, num_padded, num_pairs, hidden, inter,
        act.stride(0), w_down.stride(0), w_down.stride(1), out.stride(0),
        s2.stride_e, s2.stride_r,
        BLOCK_M=tiles.block_m, BLOCK_N=block_n_down, BLOCK_K=tiles.block_k,
        PRECISION=precision, W_SCALES=s2.mode, SB=scales.BLOCK,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out.view(t, top_k, hidden).sum(dim=1)


def route_and_experts(x: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor,
                      w_down: torch.Tensor, top_k: int, renormalize: bool,
                      weights_in_activation_dtype: bool, norm_weight: torch.Tensor | None = None,
                      eps: float = 0.0, *, w13_scale: torch.Tensor | None = None,
                      w2_scale: torch.Tensor | None = None,
                      block: tuple[int, int] | None = None) -> torch.Tensor:
    """The sparse block after its router GEMM. A few tokens (``decode.takes``): the decode
    path's two launches, routing included; else routing and alignment
    (``route.route_align``: one launch for decode batches), then ``grouped_experts``. With
    ``norm_weight`` (the decode path only), ``x`` is the residual sum and the experts read
    ``rms_norm(x, norm_weight, eps)``. With ``w13_scale`` / ``w2_scale`` (float32) the
    weights are e4m3, scaled per output channel, or per ``block`` (``(128, 128)``)."""
    scales.check_pair(w_gate_up, w_down, w13_scale, w2_scale, block)
    t = x.shape[0]
    if t == 0:
        return torch.zeros_like(x)
    if decode.takes(t, top_k, w_gate_up.shape[0]):
        return decode.routed(x, router_logits, w_gate_up, w_down, top_k, renormalize,
                             weights_in_activation_dtype, norm_weight, eps,
                             w13_scale=w13_scale, w2_scale=w2_scale, block=block)[0]
    assert norm_weight is None, "the norm is fused on the decode path only"
    tiles = _tiles(x, w_gate_up, t * top_k)
    weights, _, aligned = routing.route_align(router_logits, top_k, renormalize,
                                              weights_in_activation_dtype, tiles.block_m)
    return grouped_experts(x, w_gate_up, w_down, weights, top_k, aligned, tiles,
                           w13_scale=w13_scale, w2_scale=w2_scale, block=block)


@torch.library.custom_op("model_executor::fused_moe", mutates_args=())
def _fused_moe_op(x: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor,
                  w_down: torch.Tensor, top_k: int, renormalize: bool,
                  weights_in_activation_dtype: bool, norm_weight: torch.Tensor | None = None,
                  eps: float = 0.0, w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None, block: Sequence[int] | None = None
                  ) -> torch.Tensor:
    return route_and_experts(x, router_logits, w_gate_up, w_down, top_k, renormalize,
                             weights_in_activation_dtype, norm_weight, eps,
                             w13_scale=w13_scale, w2_scale=w2_scale, block=_block(block))


@_fused_moe_op.register_fake
def _fused_moe_fake(x: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor,
                    w_down: torch.Tensor, top_k: int, renormalize: bool,
                    weights_in_activation_dtype: bool, norm_weight: torch.Tensor | None = None,
                    eps: float = 0.0, w13_scale: torch.Tensor | None = None,
                    w2_scale: torch.Tensor | None = None, block: Sequence[int] | None = None
                    ) -> torch.Tensor:
    return torch.empty_like(x)


def _block(block: Sequence[int] | None) -> tuple[int, int] | None:
    if block is None:
        return None
    rows, cols = block
    return (int(rows), int(cols))


def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor,
              w_down: torch.Tensor, top_k: int, renormalize: bool,
              weights_in_activation_dtype: bool, norm_weight: torch.Tensor | None = None,
              eps: float = 0.0, *, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, block: tuple[int, int] | None = None
              ) -> torch.Tensor:
    """``route_and_experts``; under Dynamo one opaque custom op."""
    if torch.compiler.is_compiling():
        return torch.ops.model_executor.fused_moe(  # type: ignore[no-any-return]
            x, router_logits, w_gate_up, w_down, top_k, renormalize,
            weights_in_activation_dtype, norm_weight, eps, w13_scale, w2_scale,
            None if block is None else list(block))
    return route_and_experts(x, router_logits, w_gate_up, w_down, top_k, renormalize,
                             weights_in_activation_dtype, norm_weight, eps,
                             w13_scale=w13_scale, w2_scale=w2_scale, block=block)
