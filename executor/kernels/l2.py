# mypy: allow-untyped-defs
# (``@triton.jit`` parameters stay unannotated: Triton reads annotations as type hints.)
"""Weight prefetch into L2 while a decode step waits on latency (Hopper and later).

At small decode batches a layer's attention reads a few hundred kilobytes of KV cache
through two short launches: for several microseconds the HBM is nearly idle, and the
projections after it (o_proj, then the MLP) then stream their weights from HBM. The
decode attention kernel can instead issue bulk L2 prefetches of those weights
(``cp.async.bulk.prefetch.L2``: fire-and-forget, no registers, no ordering) in its first
instructions; the projections then find their leading bytes in L2.

``plan`` cuts the weights that follow a layer's attention, in the order they are read, to
a byte budget (a prefetch larger than what L2 keeps until the read evicts itself, and the
first experiment, which prefetched every weight inside its own GEMM, lost for that
reason: ``bench/results/2026-11-26-h200x2-fused-all-reduce``). ``prefetch_share`` lets
each program of a grid issue its equal share of a region. A prefetch has no effect on any
result: outputs are bit-identical with and without it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

#: A region's start and length must be multiples of this (the instruction's rule).
ALIGN = 16
#: Regions one launch can take (o_proj, gate_up, down).
MAX_REGIONS = 3


@triton.jit
def prefetch_l2(ptr, nbytes):
    """One bulk L2 prefetch of ``nbytes`` (a multiple of 16) at ``ptr`` (16-byte aligned),
    issued by the program's thread 0."""
    tl.inline_asm_elementwise(
        "{\n\t.reg .pred p;\n\t.reg .u32 t;\n\tmov.u32 t, %tid.x;\n\tsetp.eq.u32 p, t, 0;"
        "\n\t@p cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;\n\t}",
        "=r,l,r", [ptr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_share(ptr, nbytes, part, parts):
    """Prefetch share ``part`` of ``parts`` (about equal, in 16-byte units) of the region
    ``[ptr, ptr + nbytes)``; a share past the end issues nothing."""
    units = nbytes // 16
    per = (units + parts - 1) // parts
    start = part * per
    count = tl.minimum(per, units - start)
    if count > 0:
        prefetch_l2(ptr + start.to(tl.int64) * 16, (count * 16).to(tl.int32))


def unsupported_reason(device: torch.device | str) -> str:
    """Why weights cannot be prefetched on ``device``, or "" where they can: a CUDA device
    of compute capability 9.0 or later (the bulk prefetch), compiled Triton."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"device {device} is not CUDA"
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return "Triton interpreter"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"compute capability {major}.{minor} < 9.0 (no bulk L2 prefetch)"
    return ""


def default_budget(device: torch.device | str) -> int:
    """Bytes to prefetch per layer where none is configured: half the device's L2 (the
    other half keeps what the step reads meanwhile)."""
    props = torch.cuda.get_device_properties(torch.device(device))
    return int(props.L2_cache_size) // 2 // ALIGN * ALIGN


def plan(weights: Sequence[torch.Tensor], budget: int) -> list[torch.Tensor]:
    """Byte views of the leading bytes of ``weights``, taken in order until ``budget``
    bytes (each view a multiple of ``ALIGN`` bytes, at most ``MAX_REGIONS``). A weight
    that is not contiguous or not 16-byte aligned ends the plan: nothing after it is read
    in the order prefetched."""
    regions: list[torch.Tensor] = []
    left = budget // ALIGN * ALIGN
    for w in weights[:MAX_REGIONS]:
        if left <= 0 or not w.is_contiguous() or w.data_ptr() % ALIGN:
            break
        raw = w.detach().reshape(-1).view(torch.uint8)
        take = min(raw.numel() // ALIGN * ALIGN, left)
        if take <= 0:
            break
        regions.append(raw[:take])
        left -= take
    return regions


def launch_args(regions: Sequence[torch.Tensor], fallback: torch.Tensor) -> list[object]:
    """The ``MAX_REGIONS`` (pointer, bytes) pairs of a launch whose kernel takes
    ``prefetch_share`` arguments: the regions, then the first region (or ``fallback``
    where there is none) with 0 bytes."""
    assert len(regions) <= MAX_REGIONS
    dummy = regions[0] if regions else fallback
    args: list[object] = []
    for i in range(MAX_REGIONS):
        if i < len(regions):
            args += [regions[i], regions[i].numel()]
        else:
            args += [dummy, 0]
    return args


