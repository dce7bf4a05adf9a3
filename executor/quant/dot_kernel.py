# mypy: allow-untyped-defs
# (``@triton.jit`` parameters stay unannotated: Triton reads annotations as type hints.)
"""FP8 x FP8 tensor-core GEMM for the skinny rows of batched decode (8 to 64 rows).

``fp8_dot``: ``(q * a_scale) @ dequantize(weight).T`` with ``q`` (M, K) e4m3 rows and
their float32 scales (``act_quant``, or ``rms_norm_quant`` / ``silu_and_mul_quant``),
``weight`` (N, K) e4m3 with per-output-row or 128x128 block scales. ``tl.dot`` on e4m3
operands, float32 sums (block scales on each chunk's sums, row scales at the end). Few
rows read every weight byte once, so the work is spread over the SMs by output columns
and, where those are too few, by ``split_k`` slices of K: each slice's
partial tile goes to a float32 workspace, and the program that finishes a tile last (an
atomic counter, reset by it) sums the slices in slice order, so the result does not
depend on which program ran when. The workspace is static (allocated before capture,
``reserve``), so CUDA graphs capture the launch; no host sync. Under PDL the weight lines
a program reads first are prefetched to L2 before it waits for the previous kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from executor.kernels import pdl
from executor.kernels.fast_launch import cdiv, next_power_of_2
from executor.kernels.pdl import pdl_enter
from executor.quant.fp8 import FP8
from executor.quant.tiles import DotTile, pick_dot_tile


@triton.jit
def _fp8_dot_kernel(
    a_ptr,  # (M, K) e4m3 rows, unit column stride
    as_ptr,  # (M,) float32 row scales (contiguous)
    w_ptr,  # (N, K) e4m3, row-major
    s_ptr,  # BLOCK_SCALES: (ceil(N/SBN), ceil(K/SBK)) float32; else (N,) float32
    out_ptr,  # (M, N)
    ws_ptr,  # SPLIT_K > 1: float32 partial tiles, (tiles, SPLIT_K, BLOCK_M * BLOCK_N)
    cnt_ptr,  # SPLIT_K > 1: int32 per output tile, zero between launches
    M, N, K, k_per_split,
    stride_am, stride_wn, stride_om, stride_sn,
    SBN: tl.constexpr,
    SBK: tl.constexpr,  # a multiple of BLOCK_K (BLOCK_SCALES)
    BLOCK_SCALES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SWAP_AB: tl.constexpr,  # weight rows as the MMA's M side (tiles of few rows)
    PREFETCH: tl.constexpr,  # 128-byte lines per weight row sent to L2 before the PDL wait
    USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_m = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # (BLOCK_N, 1)
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am  # (BLOCK_M, 1)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if USE_PDL:
        # Weights are never written while a step runs: the first lines of this program's
        # slice stream into L2 while the previous kernel finishes (addresses clamped into
        # the weight, a prefetch has no mask).
        rows = tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * stride_wn
        cols = tl.minimum(k_lo + tl.arange(0, PREFETCH) * 128, k_hi - 1)[None, :]
        _prefetch_l2(w_ptr + rows + cols)
    pdl_enter(USE_PDL)  # (activations, scales, workspace: written by the step)
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < k_hi
        w = tl.load(w_rows + ks[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        a = tl.load(a_rows + ks[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        # (BLOCK_N, BLOCK_M) swapped, else (BLOCK_M, BLOCK_N); float32
        part = tl.dot(w, tl.trans(a)) if SWAP_AB else tl.dot(a, tl.trans(w))
        if BLOCK_SCALES:  # the chunk lies in one block column
            s = tl.load(s_ptr + (offs_n // SBN) * stride_sn + k0 // SBK, mask=mask_n,
                        other=0.0)
            if SWAP_AB:
                acc += part * s[:, None]
            else:
                acc += part * s[None, :]
        else:
            acc += part
    if SWAP_AB:
        acc = tl.trans(acc)  # (BLOCK_M, BLOCK_N)
    if SPLIT_K > 1:
        # This slice's partial tile into the workspace; the last program of the tile sums
        # all slices in slice order (deterministic) and writes the output.
        tile = pid_m * tl.num_programs(0) + pid_n
        local = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        ws_tile = ws_ptr + tile.to(tl.int64) * (SPLIT_K * BLOCK_M * BLOCK_N) + local
        tl.store(ws_tile + pid_k * (BLOCK_M * BLOCK_N), acc)
        tl.debug_barrier()  # every thread's part stored before the release below
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            tl.debug_barrier()
            acc = tl.load(ws_tile, cache_modifier=".cg")  # (L2: other SMs' stores)
            for j in range(1, SPLIT_K):
                acc += tl.load(ws_tile + j * (BLOCK_M * BLOCK_N), cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next launch
            _store(acc, as_ptr, s_ptr, out_ptr, offs_m, offs_n, mask_m, mask_n, stride_om,
                   BLOCK_SCALES)
    else:
        _store(acc, as_ptr, s_ptr, out_ptr, offs_m, offs_n, mask_m, mask_n, stride_om,
               BLOCK_SCALES)


@triton.jit
def _prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines at ``ptrs`` (a hint: nothing waits for it)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.b32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _store(acc, as_ptr, s_ptr, out_ptr, offs_m, offs_n, mask_m, mask_n, stride_om,
           BLOCK_SCALES: tl.constexpr):
    """The final sums times the row scales (and the weight's row scales) into ``out``."""
    if not BLOCK_SCALES:
        acc *= tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    acc *= tl.load(as_ptr + offs_m, mask=mask_m, other=0.0)[:, None]
    dst = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


class _Workspace:
    """One device's split-K scratch: float32 partial tiles and int32 tile counters (zero
    between launches: the last program of each tile resets its counter). Launches on one
    stream run one after another, so every layer shares it.

    NOTE: a captured graph keeps the buffers' addresses, so a buffer is never freed once
    handed out: growing keeps the old ones alive (only ``reserve`` before capture, or an
    eager first launch, grows it)."""

    def __init__(self) -> None:
        self.partials: torch.Tensor | None = None
        self.counters: torch.Tensor | None = None
        self._kept: list[torch.Tensor] = []

    def get(self, device: torch.device, floats: int, tiles: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.partials is None or self.partials.numel() < floats:
            self._check_not_capturing(device)
            if self.partials is not None:
                self._kept.append(self.partials)
            self.partials = torch.empty(max(floats, 1), dtype=torch.float32, device=device)
        if self.counters is None or self.counters.numel() < tiles:
            self._check_not_capturing(device)
            if self.counters is not None:
                self._kept.append(self.counters)
            self.counters = torch.zeros(max(tiles, 1), dtype=torch.int32, device=device)
        return self.partials, self.counters

    @staticmethod
    def _check_not_capturing(device: torch.device) -> None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the FP8 split-K workspace must be reserved before graph "
                               "capture (executor.quant.gemm.prepare does)")


_WORKSPACES: dict[torch.device, _Workspace] = {}


def _grid(m: int, n: int, k: int, tile: DotTile) -> tuple[int, int, int, int, int]:
    """(programs over N, split, programs over M, K per split, rows per program)."""
    bm = block_m(m)
    chunks = cdiv(k, tile.block_k)
    split = max(1, min(tile.split_k, chunks))
    k_per = cdiv(chunks, split) * tile.block_k
    return cdiv(n, tile.block_n), cdiv(k, k_per), cdiv(m, bm), k_per, bm


def block_m(m: int) -> int:
    """Rows per program: 16 (``tl.dot``'s least) to 64."""
    return min(max(16, next_power_of_2(m)), 64)


def reserve(device: torch.device, m: int, n: int, k: int, tile: DotTile) -> None:
    """Make the device's workspace big enough for ``m`` rows of (N, K) with ``tile``
    (before graph capture)."""
    gn, split, gm, _, bm = _grid(m, n, k, tile)
    if split > 1:
        _WORKSPACES.setdefault(device, _Workspace()).get(
            device, gn * gm * split * bm * tile.block_n, gn * gm)


def fp8_dot(q: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
            block: tuple[int, int] | None, out_dtype: torch.dtype,
            tile: DotTile | None = None) -> torch.Tensor:
    """``(q * a_scale) @ dequantize(weight).T`` in ``out_dtype``: ``q`` (M, K) e4m3,
    ``a_scale`` (M,) or (M, 1) float32, ``weight`` (N, K) e4m3, ``scale`` (N,) row scales
    or block scales (with ``block``). A new (M, N) tensor. ``tile``: the launch shape
    (default: ``tiles.pick_dot_tile``)."""
    assert q.dim() == 2 and q.stride(-1) == 1 and q.dtype == FP8 and weight.dtype == FP8
    m, k = q.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and a_scale.numel() == m, (q.shape, weight.shape)
    out = torch.empty((m, n), dtype=out_dtype, device=q.device)
    if m == 0:
        return out
    if tile is None:
        from executor.kernels.skinny.tiles import device_name

        name = device_name(q.device) if q.is_cuda else ""
        tile = pick_dot_tile(m, n, k, block is not None, name)
    sbn, sbk = block or (1, 1)
    assert block is None or sbk % tile.block_k == 0, (tile, block)
    gn, split, gm, k_per, bm = _grid(m, n, k, tile)
    a_scale = a_scale.reshape(-1)
    assert a_scale.is_contiguous() and a_scale.dtype == torch.float32
    ws, cnt = out, a_scale  # (unread without a split)
    if split > 1:
        ws, cnt = _WORKSPACES.setdefault(q.device, _Workspace()).get(
            q.device, gn * gm * split * bm * tile.block_n, gn * gm)
    _fp8_dot_kernel[(gn, split, gm)](
        q, a_scale, weight, scale, out, ws, cnt, m, n, k, k_per, q.stride(0),
        weight.stride(0), out.stride(0), scale.stride(0), SBN=sbn, SBK=sbk,
        BLOCK_SCALES=block is not None, BLOCK_M=bm, BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, SPLIT_K=split, SWAP_AB=tile.swap_ab,
        PREFETCH=min(8, next_power_of_2(cdiv(k_per, 128))), num_warps=tile.num_warps,
        num_stages=tile.num_stages or _stages(q.device), **pdl.options())
    return out


def _stages(device: torch.device) -> int:
    from executor.quant.launch import stages

    return stages(device)

