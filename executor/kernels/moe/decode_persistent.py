# mypy: allow-untyped-defs
# (``@triton.jit`` parameters stay unannotated: Triton reads annotations as type hints.)
"""The experts of one token in one launch: gate_up's programs go on to do down.

``decode.routed`` at one token launches gate_up, then down. Down cannot name its weights
before gate_up's grid has completed (PDL lets it wait only on the whole grid), and its
programs find no registers until gate_up's leave, so each sparse layer pays a launch
boundary, the routing load and the first weight latency twice. Here the grid is gate_up's
(one program per routed pair and column block) and every program stays resident: after
its block of activations it arrives at a counter, the first ``cdiv(H, BLOCK_N_DOWN)``
programs issue the first chunk of their down columns (the experts are known from the
routing each program already holds), wait until every program has arrived, and stream
down as ``_moe_decode_down_kernel`` does (the same rounding and order: the same bits).

The wait is a spin on a device counter, so the launch must fit on the GPU at once:
``fits`` compares the grid with the programs the compiled kernel leaves resident (its
registers capped by ``register_cap`` for that), and ``decode.routed`` takes this path
only then (under the interpreter, whose programs run one after another, only for a grid
of one program). Each grid size has its own counter, which only grows (int64): launch
``n`` waits for ``(n + 1) * grid`` arrivals, so nothing resets it between launches or
graph replays. bf16 / fp16 / fp32 weights only.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from executor.kernels import pdl
from executor.kernels.cache_policy import STREAM
from executor.kernels.moe.decode_parts import (
    _down_ptrs,
    _down_store,
    _down_stream,
    _gate_up_pair,
    _route_pair,
)
from executor.kernels.pdl import pdl_enter
from executor.kernels.skinny.tiles import SM_REGISTERS, resident_programs

#: Below this many registers a thread the two phases spill heavily: two launches instead.
MIN_REGISTERS = 160


@triton.jit
def _moe_decode_one_token_kernel(
    x_ptr, nw_ptr, logits_ptr,  # as gate_up's (one token)
    w13_ptr,  # (E, 2 * N, K)
    act_ptr,  # (TOP_K, N) scratch, by slot
    w2_ptr,  # (E, K, N)
    out_ptr,  # (1, K)
    weights_ptr, ids_ptr,  # (1, TOP_K) float32 / int32 out
    count_ptr,  # (1,) int64 arrivals, never reset
    num_experts, n_cols, k_dim,
    stride_l, stride_we, stride_wn, stride_w2e, stride_w2n,
    inv_k, eps,
    TOP_K: tl.constexpr, E_POW2: tl.constexpr, K_POW2: tl.constexpr,
    RENORMALIZE: tl.constexpr, ROUND_TO_ACT: tl.constexpr,
    HAS_NORM: tl.constexpr, BLOCK_ROW: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_N_DOWN: tl.constexpr, BLOCK_K_DOWN: tl.constexpr,
    ROUTE_ROWS: tl.constexpr, USE_PDL: tl.constexpr,
    MAX_POLLS: tl.constexpr = 1 << 22,  # seconds of polling: far past any real wait
):
    pdl_enter(USE_PDL)
    p = tl.program_id(0)
    nb = tl.cdiv(n_cols, BLOCK_N)
    pair = p // nb
    pid_n = p % nb
    expert, top_w, top_i = _route_pair(logits_ptr, weights_ptr, ids_ptr, pair, pid_n,
                                       num_experts, stride_l, TOP_K, E_POW2, K_POW2,
                                       RENORMALIZE, ROUND_TO_ACT, ROUTE_ROWS)
    _gate_up_pair(x_ptr, nw_ptr, w13_ptr, w13_ptr, act_ptr, expert, pair, pid_n, n_cols,
                  k_dim, 0, stride_we, stride_wn, 0, 0, inv_k, eps, TOP_K, HAS_NORM,
                  BLOCK_ROW, BLOCK_N, BLOCK_K, 0, 1, 0)
    # arrive: every thread's activations stored before the one release
    tl.debug_barrier()
    ticket = tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")
    if p < tl.cdiv(k_dim, BLOCK_N_DOWN):
        copy = tl.arange(0, ROUTE_ROWS)[:, None]  # the routing's first copy
        ids = tl.sum(tl.where(copy == 0, top_i, 0), axis=0)  # (K_POW2,)
        scale = tl.sum(tl.where(copy == 0, top_w, 0.0), axis=0)
        slots = tl.arange(0, K_POW2)
        slot_ok = slots < TOP_K
        experts = tl.minimum(ids, num_experts - 1).to(tl.int64)  # as gate_up reads them
        cols = p * BLOCK_N_DOWN + tl.arange(0, BLOCK_N_DOWN)
        ks = tl.arange(0, BLOCK_K_DOWN)
        w_ptrs, a_ptrs, rows_ok, s_ok, col_ok = _down_ptrs(
            w2_ptr, act_ptr, experts, 0, slots, slot_ok, cols, ks, k_dim, n_cols,
            stride_w2e, stride_w2n)
        w = tl.load(w_ptrs, mask=rows_ok & (ks < n_cols)[None, None, :], other=0.0,
                    eviction_policy=STREAM)
        # wait for every program's activations (launch n waits for (n + 1) * grid); a grid
        # that is not resident at once would never arrive: after MAX_POLLS the launch fails
        # (a CUDA error the server reports as fatal) instead of hanging the GPU
        target = (ticket // tl.num_programs(0) + 1) * tl.num_programs(0)
        seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
        polls = 0
        while (seen < target) & (polls < MAX_POLLS):
            seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
            polls += 1
        if seen < target:
            _trap(seen)
        tl.debug_barrier()
        # (activations through L2: ``.cg``, written by other programs of this launch)
        acc = _down_stream(w, w_ptrs, a_ptrs, rows_ok, ks, n_cols, slot_ok, w_ptrs, s_ok, 0,
                           1, K_POW2, BLOCK_N_DOWN, BLOCK_K_DOWN, ".cg")
        _down_store(acc, scale, w_ptrs, s_ok, out_ptr, cols, col_ok, 0)


@triton.jit
def _trap(x):
    """End the kernel with an error (PTX ``trap``): the launch fails, the context with it."""
    tl.inline_asm_elementwise("trap;\n\tmov.b32 $0, 0;", "=r,r", [x.to(tl.int32)],
                              dtype=tl.int32, is_pure=False, pack=1)


@functools.cache
def _counter(device: torch.device, programs: int) -> torch.Tensor:
    """The arrival counter of the launches of ``programs`` programs on ``device``: between
    two such launches it holds a multiple of ``programs`` (launches never overlap, each
    kernel of a step waiting for its predecessor before the next may start)."""
    return torch.zeros(1, dtype=torch.int64, device=device)


_FITS: dict[tuple[object, ...], bool] = {}


def register_cap(programs: int, num_warps: int, sms: int) -> int:
    """Registers a thread may take so that ``programs`` programs of ``num_warps`` warps
    are resident on ``sms`` multiprocessors at once (a multiple of 8, at most 255)."""
    per_sm = triton.cdiv(programs, sms)
    return min(255, SM_REGISTERS // (per_sm * num_warps * 32) // 8 * 8)


def fits(key: tuple[object, ...], args: tuple[object, ...], constexprs: dict[str, object],
         programs: int, num_warps: int, maxnreg: int, device: torch.device) -> bool:
    """Whether ``programs`` programs of the kernel compiled for ``args`` and
    ``constexprs`` (at most ``maxnreg`` registers a thread) are resident on ``device`` at
    once (compiled, not launched, to read its registers and shared memory; false where
    Triton cannot say)."""
    found = _FITS.get(key)
    if found is None:
        try:
            kernel = _moe_decode_one_token_kernel.warmup(
                *args, grid=(1,), **constexprs, num_warps=num_warps, maxnreg=maxnreg,
                **pdl.options())
            kernel._init_handles()
            props = torch.cuda.get_device_properties(device)
            per_sm = resident_programs(
                kernel.n_regs, num_warps, int(kernel.metadata.shared),
                max_warps=props.max_threads_per_multi_processor // 32,
                shared_per_sm=props.shared_memory_per_multiprocessor)
            found = programs <= per_sm * props.multi_processor_count
        except Exception:  # an older or newer Triton: the two launches serve
            found = False
        _FITS[key] = found
    return found


def try_one_launch(x: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor,
                   w_down: torch.Tensor, out: torch.Tensor, act: torch.Tensor,
                   weights: torch.Tensor, ids: torch.Tensor, top_k: int, renormalize: bool,
                   weights_in_activation_dtype: bool, norm_weight: torch.Tensor | None,
                   eps: float, block_n: int, block_k: int, block_n_down: int,
                   block_k_down: int, num_warps: int, sms: int) -> bool:
    """Run one token's experts in one launch into ``out`` (and the routing into
    ``weights`` / ``ids``) where the grid fits the GPU (``sms`` multiprocessors) at once;
    false (nothing launched) otherwise. ``act`` is ``(top_k, N)`` scratch."""
    if x.shape[0] != 1:
        return False
    experts, two_i, hidden = w_gate_up.shape
    inter = two_i // 2
    programs = top_k * triton.cdiv(inter, block_n)
    if triton.cdiv(hidden, block_n_down) > programs or (not x.is_cuda and programs > 1):
        return False  # (the interpreter runs one program after another: one never waits)
    maxnreg = register_cap(programs, num_warps, sms)
    if x.is_cuda and maxnreg < MIN_REGISTERS:
        return False
    args = (x, norm_weight if norm_weight is not None else x, router_logits, w_gate_up, act,
            w_down, out, weights, ids, _counter(x.device, programs), experts, inter, hidden,
            router_logits.stride(0), w_gate_up.stride(0), w_gate_up.stride(1),
            w_down.stride(0), w_down.stride(1), 1.0 / hidden, eps)
    constexprs = dict(
        TOP_K=top_k, E_POW2=triton.next_power_of_2(experts), K_POW2=triton.next_power_of_2(top_k),
        RENORMALIZE=renormalize, ROUND_TO_ACT=weights_in_activation_dtype,
        HAS_NORM=norm_weight is not None, BLOCK_ROW=triton.next_power_of_2(hidden),
        BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_N_DOWN=block_n_down,
        BLOCK_K_DOWN=block_k_down, ROUTE_ROWS=num_warps)
    options = dict(num_warps=num_warps, **pdl.options())
    if x.is_cuda:  # registers capped so that the grid can be resident at once, if it is
        key = (x.device, x.dtype, w_gate_up.shape, pdl.enabled(), tuple(constexprs.items()))
        if not fits(key, args, constexprs, programs, num_warps, maxnreg, x.device):
            return False
        options["maxnreg"] = maxnreg
    _moe_decode_one_token_kernel[(programs,)](*args, **constexprs, **options)
    return True
