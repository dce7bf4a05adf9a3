# mypy: allow-untyped-defs
# (``@triton.jit`` parameters stay unannotated: Triton reads annotations as type hints.)
"""Programmatic dependent launch (PDL) for our Triton kernels (Hopper and later).

Inside a CUDA graph a kernel normally starts only once its predecessor has finished and
drained: at decode batch 1 that costs a gap and a ramp of a few microseconds at each of
the ~7 kernel boundaries of a layer. A kernel launched with PDL may start while its
predecessor still runs. Each of our kernels is written for that:

1. first it does what depends on nothing the step writes: the skinny GEMM loads its first
   weight chunk (weights are never written while a step runs);
2. then every program waits (``griddepcontrol.wait``) until the predecessor grid has
   completed and its writes are visible;
3. then it lets its own successor launch (``griddepcontrol.launch_dependents``): that
   successor's programs take SM slots as ours retire and do their own step 1.

Rules a kernel launched with PDL must keep, or it races:

- no load of anything a kernel of the step may have written, and no store at all, before
  the wait (a store could overwrite what the predecessor still reads);
- every program waits, whatever path it takes (``pdl_enter`` at the top does that; the
  order stays transitive because each predecessor waited for its own).

Kernels that are not ours (cuBLAS, torch's, Inductor's) are launched as before and wait
for their predecessor to finish; a PDL kernel after one of them waits for its completion.
Results are bit-identical with and without PDL: only the timing of loads changes.

The switch is process-wide: kernels are launched from deep in the model, and each launch
reads ``enabled()``, which is part of the kernel's specialization (``USE_PDL`` constexpr
and the ``launch_pdl`` option). An executor resolves ``ExecutorConfig.pdl`` once
(``resolve``) and sets the switch to its choice (``use``) before each forward and capture,
so executors sharing a process launch as each was configured.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from executor.config import KERNEL_SWITCH_MODES

_enabled = False


def enabled() -> bool:
    """Whether kernels launch with PDL now (the ``USE_PDL`` constexpr and ``launch_pdl``)."""
    return _enabled


def options() -> dict[str, bool]:
    """Launch keyword arguments for a PDL-aware kernel: its ``USE_PDL`` constexpr, and the
    ``launch_pdl`` option when on (the interpreter and older Triton know no such option)."""
    return _ON if _enabled else _OFF


#: The launch option, passed only when on: the interpreter and older Triton know none.
LAUNCH_OPTION = {"launch_pdl": True}
_ON = {"USE_PDL": True, **LAUNCH_OPTION}
_OFF = {"USE_PDL": False}


def use(on: bool) -> None:
    """Set the switch to a value ``resolve`` returned (an executor about to run)."""
    global _enabled
    _enabled = on


def unsupported_reason(device: torch.device | str) -> str:
    """Why PDL cannot be used on ``device``, or "" where it can: a CUDA device of compute
    capability 9.0 or later, compiled Triton (not its interpreter) with the launch option
    and the ``griddepcontrol`` intrinsics."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"device {device} is not CUDA"
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return "Triton interpreter"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"compute capability {major}.{minor} < 9.0"
    cuda_lang = getattr(getattr(tl, "extra", None), "cuda", None)
    if not all(hasattr(cuda_lang, f) for f in ("gdc_wait", "gdc_launch_dependents")):
        return f"triton {triton.__version__} has no griddepcontrol intrinsics"
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return f"triton {triton.__version__} has no CUDA backend options"
    if "launch_pdl" not in getattr(CUDAOptions, "__dataclass_fields__", {}):
        return f"triton {triton.__version__} has no launch_pdl option"
    return ""


def resolve(mode: str, device: torch.device | str) -> bool:
    """Whether ``mode`` means PDL on ``device``: ``auto`` (on where supported), ``on``
    (ValueError where unsupported), ``off``. The switch itself is set by ``use``."""
    if mode not in KERNEL_SWITCH_MODES:
        raise ValueError(f"pdl mode must be one of {KERNEL_SWITCH_MODES}, got {mode!r}")
    reason = "" if mode == "off" else unsupported_reason(device)
    if mode == "on" and reason:
        raise ValueError(f"programmatic dependent launch is not available: {reason}")
    return mode != "off" and not reason


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """Step 2 and 3 above: wait for the predecessor grid, then let the successor launch.
    Call it in every program before the first load of step data and the first store."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
