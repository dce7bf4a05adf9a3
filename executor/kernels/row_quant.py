# mypy: allow-untyped-defs
# (``@triton.jit`` parameters stay unannotated: Triton reads annotations as type hints.)
"""Rows to FP8 (e4m3) with a per-row scale, inside the kernel that made them.

``quantize_store`` is ``executor.quant.kernels._act_quant_kernel``'s dynamic arithmetic
(the row's largest magnitude over 448, correctly rounded, at least 1e-12; values divided
by it, correctly rounded, clamped), so a norm or SiLU-and-mul that quantizes its own
output writes what that kernel would write from its activation-dtype output.
"""

from __future__ import annotations

import triton
import triton.language as tl

# (constexpr: a jitted function reads only constexpr globals)
FP8_MAX = tl.constexpr(448.0)
MIN_SCALE = tl.constexpr(1e-12)


@triton.jit
def row_scale(amax):
    """The scale of a row whose largest magnitude is ``amax`` (float32)."""
    return tl.maximum(tl.div_rn(amax, FP8_MAX), MIN_SCALE)


@triton.jit
def quantize_store(v32, scale, q_ptrs, mask):
    """Store ``v32`` (float32 values of the activation dtype) divided by ``scale`` as e4m3."""
    q = tl.clamp(tl.div_rn(v32, scale), -FP8_MAX, FP8_MAX)
    tl.store(q_ptrs, q.to(q_ptrs.dtype.element_ty), mask=mask)
