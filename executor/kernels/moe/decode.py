# mypy: allow-untyped-defs
# (``@triton.jit`` parameters stay unannotated: Triton reads annotations as type hints.)
"""The experts at a few tokens (decode): two GEMV-style launches, no alignment, no sum after.

``_moe_decode_gate_up_kernel``: programs over (routed pair ``t * top_k + j``, block of the
experts' columns). Each routes its token itself from the router logits (``route.topk_rows``
on one copy of the row of ``E`` logits a warp, so no pick waits on a barrier; no routing
launch) and streams its expert's gate and up rows, SiLU-and-mul fused; the first block of
slot 0 stores the token's weights and ids for the down pass. With a norm weight its input
is the residual sum, RMS-normed in the kernel as ``executor.kernels.norm`` rounds it (the
router GEMM takes the norm fused: no norm launch).
``_moe_decode_down_kernel``: programs over (token, block of hidden columns); each reads its
columns of the token's ``top_k`` experts at once (a ``(top_k, BLOCK_N, BLOCK_K)`` tile per
step), rounds each expert's output, scales it by its routing weight, rounds, and sums the
``top_k`` in float32 in one program: deterministic, as the grouped path rounds. Each pair
streams its own expert, so the path serves only while pairs rarely share one (``takes``).
FP8 weights (``scales``) are converted to float32 in registers, as the bf16 ones are.
At one token of bf16 / fp16 / fp32 experts, ``decode_persistent`` runs both in one launch
(down in gate_up's grid) where the grid fits the GPU at once.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from executor.kernels import pdl, switches
from executor.kernels.cache_policy import STREAM
from executor.kernels.moe import decode_persistent, scales
from executor.kernels.moe.decode_parts import (
    _down_chunk,
    _down_ptrs,
    _down_store,
    _down_stream,
    _gate_up_pair,
    _route_pair,
)
from executor.kernels.pdl import pdl_enter

#: Tokens up to which the decode path may serve (``takes``).
DECODE_MAX_TOKENS = 4


def takes(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether the decode path runs ``num_tokens`` tokens: at most ``DECODE_MAX_TOKENS``,
    and past one token few enough pairs that two rarely route to the same expert (each
    pair streams its expert's weights; the grouped path reads a shared expert once)."""
    return 0 < num_tokens <= DECODE_MAX_TOKENS and (
        num_tokens == 1 or 4 * num_tokens * top_k <= num_experts)


@triton.jit
def _moe_decode_gate_up_kernel(
    x_ptr,  # (T, K): the experts' input, or with HAS_NORM the residual sum to normalize
    nw_ptr,  # (K,) RMSNorm weight (HAS_NORM)
    logits_ptr,  # (T, E) router logits
    w_ptr,  # (E, 2 * N, K): gate rows [0, N), up rows [N, 2N); e4m3 with W_SCALES
    s_ptr,  # W_SCALES 1: (E, 2 * N) float32; 2: (E, 2 * N / SB, cdiv(K, SB))
    act_ptr,  # (T * TOP_K, N) out, by pair
    weights_ptr, ids_ptr,  # (T, TOP_K) float32 / int32 out
    num_experts, n_cols, k_dim,
    stride_x, stride_l, stride_we, stride_wn, stride_se, stride_sr,
    inv_k, eps,
    TOP_K: tl.constexpr, E_POW2: tl.constexpr, K_POW2: tl.constexpr,
    RENORMALIZE: tl.constexpr, ROUND_TO_ACT: tl.constexpr,
    HAS_NORM: tl.constexpr, BLOCK_ROW: tl.constexpr,  # next_power_of_2(K) (HAS_NORM)
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    W_SCALES: tl.constexpr, SB: tl.constexpr,  # scales.NONE/CHANNEL/BLOCKS, block size
    STAGES: tl.constexpr,  # 0: the next chunk prefetched in registers; >= 2: pipelined
    ROUTE_ROWS: tl.constexpr,  # copies of the token's logits row (num_warps)
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)  # everything it reads but the weights comes from the step
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert, _, _ = _route_pair(logits_ptr, weights_ptr, ids_ptr, pair, pid_n, num_experts,
                               stride_l, TOP_K, E_POW2, K_POW2, RENORMALIZE, ROUND_TO_ACT,
                               ROUTE_ROWS)
    _gate_up_pair(x_ptr, nw_ptr, w_ptr, s_ptr, act_ptr, expert, pair, pid_n, n_cols, k_dim,
                  stride_x, stride_we, stride_wn, stride_se, stride_sr, inv_k, eps, TOP_K,
                  HAS_NORM, BLOCK_ROW, BLOCK_N, BLOCK_K, W_SCALES, SB, STAGES)


@triton.jit
def _moe_decode_down_kernel(
    act_ptr,  # (T * TOP_K, K) activations, by pair
    w_ptr,  # (E, N, K); e4m3 with W_SCALES
    s_ptr,  # W_SCALES 1: (E, N) float32; 2: (E, cdiv(N, SB), K / SB)
    out_ptr,  # (T, N)
    weights_ptr, ids_ptr,  # (T, TOP_K) float32 / int32
    num_experts, n_cols, k_dim,
    stride_we, stride_wn, stride_o, stride_se, stride_sr,
    TOP_K: tl.constexpr, K_POW2: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    W_SCALES: tl.constexpr, SB: tl.constexpr,
    STAGES: tl.constexpr,  # as gate_up's
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    slots = tl.arange(0, K_POW2)
    slot_ok = slots < TOP_K
    expert = tl.load(ids_ptr + t * TOP_K + slots, mask=slot_ok, other=0)
    expert = tl.minimum(expert, num_experts - 1).to(tl.int64)  # as gate_up reads them
    scale = tl.load(weights_ptr + t * TOP_K + slots, mask=slot_ok, other=0.0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    w_ptrs, a_ptrs, rows_ok, s_ok, col_ok = _down_ptrs(
        w_ptr, act_ptr, expert, t * TOP_K, slots, slot_ok, cols, ks, n_cols, k_dim,
        stride_we, stride_wn)
    if W_SCALES == 2:  # (K_POW2, BLOCK_N): each expert's row's block row
        s_ptrs = s_ptr + expert[:, None] * stride_se + (cols // SB)[None, :] * stride_sr
    else:
        s_ptrs = s_ptr + expert[:, None] * stride_se + cols[None, :]
    if STAGES == 0:  # the next chunk in flight in registers, as in gate_up
        w = tl.load(w_ptrs, mask=rows_ok & (ks < k_dim)[None, None, :], other=0.0,
                    eviction_policy=STREAM)
        acc = _down_stream(w, w_ptrs, a_ptrs, rows_ok, ks, k_dim, slot_ok, s_ptrs, s_ok,
                           W_SCALES, SB, K_POW2, BLOCK_N, BLOCK_K, "")
    else:  # pipelined, as in gate_up
        acc = tl.zeros((K_POW2, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k in tl.range(0, k_dim, BLOCK_K, num_stages=STAGES):
            w = tl.load(w_ptrs + k, mask=rows_ok & (ks + k < k_dim)[None, None, :], other=0.0,
                        eviction_policy=STREAM)
            acc = _down_chunk(acc, w, k, ks, k_dim, a_ptrs, slot_ok, s_ptrs, s_ok, W_SCALES,
                              SB, K_POW2, BLOCK_N, BLOCK_K, "")
    _down_store(acc, scale, s_ptrs, s_ok, out_ptr + t * stride_o, cols, col_ok, W_SCALES)


@dataclass(frozen=True)
class DecodeTiles:
    """Columns and reduction chunk per program of each launch, and how the weight chunks
    stream (``stages``: 0, the next one prefetched in registers; 2 or more, that many in
    flight through Triton's pipelined loop)."""

    block_n: int  # gate_up: columns of gate (and as many of up)
    block_k: int
    block_n_down: int
    block_k_down: int
    num_warps: int = 4
    num_warps_down: int = 4
    stages: int = 0
    stages_down: int = 0


def _narrow(rows: int, cols: int, widest: int, narrowest: int, programs: int) -> int:
    """The widest power-of-two column block (down to ``narrowest``) that still gives
    ``programs`` programs over ``rows`` rows of ``cols`` columns."""
    block = widest
    while block > narrowest and rows * triton.cdiv(cols, block) < programs:
        block //= 2
    return block


@functools.lru_cache(maxsize=64)
def pick_tiles(num_tokens: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype,
               sms: int, w_scales: int = scales.NONE) -> DecodeTiles:
    """Blocks narrowed until about two programs per multiprocessor stream weights, and
    reduction chunks that keep each load at a few thousand elements (wide, many in
    flight, without spilling the float32 accumulators, which bound FP8 weights' chunks
    too; the kernels split a block-scaled chunk wider than a block into its blocks). FP8
    rows are half the bytes: down's blocks narrow to 4 columns and both kernels stream
    through Triton's pipelined loop (as the tile sweep at one token measured fastest)."""
    fp8 = w_scales != scales.NONE
    elems = 4096 if dtype == torch.float32 else 8192
    block_n = _narrow(num_tokens * top_k, inter, 32, 8, 2 * sms)
    block_k = min(triton.next_power_of_2(hidden), max(16, elems // (2 * block_n)))
    block_n_down = _narrow(num_tokens, hidden, 32, 4 if fp8 else 8, 2 * sms)
    k_pow2 = triton.next_power_of_2(top_k)
    block_k_down = min(triton.next_power_of_2(inter), max(16, elems // (k_pow2 * block_n_down)))
    tiles = DecodeTiles(block_n, min(block_k, 256), block_n_down, min(block_k_down, 256))
    if not fp8:
        return tiles
    return dataclasses.replace(tiles, block_k_down=min(block_k_down, scales.BLOCK),
                               stages=4 if w_scales == scales.CHANNEL else 3, stages_down=3)


@functools.lru_cache(maxsize=8)
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def routed(x: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor,
           w_down: torch.Tensor, top_k: int, renormalize: bool,
           weights_in_activation_dtype: bool, norm_weight: torch.Tensor | None = None,
           eps: float = 0.0, tiles: DecodeTiles | None = None, *,
           w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
           block: tuple[int, int] | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out (T, H), weights (T, top_k) float32, ids (T, top_k) int32)``: the routing of
    ``router_logits`` (as ``route.route_topk``) and the experts on ``x`` (with
    ``norm_weight``: on ``rms_norm(x, norm_weight, eps)``), in two launches (one token of
    bf16 / fp16 / fp32 experts: in one where ``decode_persistent`` can and the
    ``moe_one_launch`` switch is on). With ``w13_scale`` / ``w2_scale`` the weights are
    e4m3, scaled per output channel or (with ``block``) per block as ``scales``
    describes."""
    t, hidden = x.shape
    experts, two_i, _ = w_gate_up.shape
    inter = two_i // 2
    assert w_gate_up.shape[2] == hidden and w_down.shape == (experts, hidden, inter)
    assert router_logits.shape == (t, experts) and router_logits.stride(-1) == 1
    assert x.stride(-1) == 1 and w_gate_up.stride(-1) == 1 and w_down.stride(-1) == 1
    assert norm_weight is None or (norm_weight.shape == (hidden,)
                                   and norm_weight.is_contiguous())
    s13, s2 = scales.check_pair(w_gate_up, w_down, w13_scale, w2_scale, block)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=x.device)
    out = torch.empty_like(x)
    if t == 0:
        return out, weights, ids
    sms = _multiprocessors(x.device)
    if tiles is None:
        tiles = pick_tiles(t, top_k, hidden, inter, x.dtype, sms, s13.mode)
    act = torch.empty((t * top_k, inter), dtype=x.dtype, device=x.device)
    one_launch = tiles.stages == 0 and s13.mode == scales.NONE \
        and switches.active().moe_one_launch
    if one_launch and decode_persistent.try_one_launch(
            x, router_logits, w_gate_up, w_down, out, act, weights, ids, top_k, renormalize,
            weights_in_activation_dtype, norm_weight, eps, tiles.block_n, tiles.block_k,
            tiles.block_n_down, tiles.block_k_down, tiles.num_warps, sms):
        return out, weights, ids
    k_pow2 = triton.next_power_of_2(top_k)
    _moe_decode_gate_up_kernel[(t * top_k, triton.cdiv(inter, tiles.block_n))](
        x, norm_weight if norm_weight is not None else x, router_logits, w_gate_up, s13.scale,
        act, weights, ids, experts, inter, hidden,
        x.stride(0), router_logits.stride(0), w_gate_up.stride(0), w_gate_up.stride(1),
        s13.stride_e, s13.stride_r, 1.0 / hidden, eps,
        TOP_K=top_k, E_POW2=triton.next_power_of_2(experts), K_POW2=k_pow2,
        RENORMALIZE=renormalize, ROUND_TO_ACT=weights_in_activation_dtype,
        HAS_NORM=norm_weight is not None, BLOCK_ROW=triton.next_power_of_2(hidden),
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, W_SCALES=s13.mode, SB=scales.BLOCK,
        STAGES=tiles.stages, ROUTE_ROWS=tiles.num_warps, num_warps=tiles.num_warps,
        **pdl.options())
    _moe_decode_down_kernel[(t, triton.cdiv(hidden, tiles.block_n_down))](
        act, w_down, s2.scale, out, weights, ids, experts, hidden, inter,
        w_down.stride(0), w_down.stride(1), out.stride(0), s2.stride_e, s2.stride_r,
        TOP_K=top_k, K_POW2=k_pow2, BLOCK_N=tiles.block_n_down, BLOCK_K=tiles.block_k_down,
        W_SCALES=s2.mode, SB=scales.BLOCK, STAGES=tiles.stages_down,
        num_warps=tiles.num_warps_down, **pdl.options())
    return out, weights, ids
