"""Triton's interpreter for a test module (the CPU suite's kernel tests).

``interpreter_triton()``, called at a module's top before anything imports Triton, skips
the module where CUDA is present (the ``gpu`` tests cover the compiled kernels) or Triton
is missing, turns the interpreter on, and returns the ``triton`` module; it skips too if
Triton was imported before the interpreter could be turned on.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch


def interpreter_triton() -> Any:
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the gpu tests cover the compiled kernels",
                    allow_module_level=True)
    if "triton" not in sys.modules:  # must precede the first ``import triton``
        os.environ["TRITON_INTERPRET"] = "1"
    triton = pytest.importorskip("triton", reason="triton is not installed")
    if type(triton.language.sum).__name__ != "InterpretedFunction":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set (set it in the "
                    "environment or run this file in its own process)",
                    allow_module_level=True)
    return triton


def half_ulp(ref: torch.Tensor) -> torch.Tensor:
    """Half an fp16 ulp of each reference value, plus float32 summation-order slack."""
    return ref.abs() * 2.0**-11 + ref.abs().amax() * 1e-5 + 1e-6
