# mypy: allow-untyped-defs
# (``@triton.jit`` parameters stay unannotated: Triton reads annotations as type hints.)
"""Attention scores in base 2, optionally soft-capped (Gemma 2's ``attn_logit_softcapping``:
``cap * tanh(score / cap)``), shared by the decode and extend kernels.

The host folds the constants (``score_scales``); a kernel compiled without ``SOFTCAP``
does exactly the one multiply it did before the cap existed.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl


def score_scales(sm_scale: float, softcap: float) -> tuple[float, float]:
    """The kernels' ``(sm_scale_log2, cap_log2)``: ``scale * log2(e)`` and unused without
    a cap; with one, ``scale / cap`` (the tanh's argument) and ``cap * log2(e)``."""
    if softcap > 0:
        return sm_scale / softcap, softcap * math.log2(math.e)
    return sm_scale * math.log2(math.e), 0.0


@triton.jit
def scaled_scores(dot, sm_scale_log2, cap_log2, SOFTCAP: tl.constexpr):
    """Base-2 scores of raw dot products: ``dot * scale * log2(e)``, or with SOFTCAP
    ``cap * tanh(dot * scale / cap) * log2(e)`` (``sm_scale_log2`` is then scale / cap)."""
    if SOFTCAP:
        # tanh(x) = 1 - 2 / (exp(2x) + 1): saturates to +-1 (exp2 overflows to inf
        # harmlessly), accurate to float32 rounding for the capped range.
        e = tl.exp2((dot * sm_scale_log2) * (2.0 * 1.4426950408889634))
        return (1.0 - 2.0 / (e + 1.0)) * cap_log2
    return dot * sm_scale_log2
