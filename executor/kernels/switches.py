"""The process-wide kernel switches: programmatic dependent launch, the row kernel, the FP8
gated epilogue, the one-launch MoE decode.

Kernels are launched from deep inside the model, and a switch is part of each launch's
specialization, so the switches are read at launch (``active()``), not passed down. One
object owns them: an executor resolves its ``KernelSwitches`` once at boot and holds them
active (``with switches:``) around each forward and capture, so executors sharing a
process (tests, A/B benchmarks) each launch as they were configured. This module imports
neither Triton nor CUDA: a CPU executor resolves its switches without them.
"""

from __future__ import annotations

import dataclasses
import os
from types import TracebackType

import torch

from executor.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class KernelSwitches:
    #: Launch our Triton kernels with programmatic dependent launch (``kernels/pdl.py``).
    pdl: bool = False
    #: Let one-row skinny GEMM launches take the persistent row kernel where it serves.
    row_kernel: bool = True
    #: Let an FP8 gate|up projection of fewer than 8 rows end in ``silu(gate) * up``
    #: (``executor.quant.launch.w8a16_glu``), its down projection then taking a plain input.
    fp8_glu: bool = True
    #: Let one token's routed experts run in one launch (``kernels/moe/decode_persistent``:
    #: down in gate_up's grid behind a device-wide spin) where the grid fits the GPU.
    moe_one_launch: bool = True

    @staticmethod
    def resolve(pdl: str, row_kernel: str, device: torch.device,
                fp8_glu: str = "auto", moe_one_launch: str = "auto") -> KernelSwitches:
        """The switches ``--pdl``, ``--skinny-row-kernel``, ``--fp8-glu`` and
        ``--moe-one-launch`` (``auto``/``on``/``off``) mean on ``device``; ConfigError for
        ``on`` where a switch cannot be on. ``fp8_glu`` is on unless ``off``: it acts only
        where projections are held in FP8 (FP8 GPUs), which the loader decides, not this;
        ``moe_one_launch`` acts only for mixture-of-experts models."""
        pdl_on = False
        if device.type == "cuda" or pdl == "on":
            reason = "" if pdl == "off" else pdl_unsupported_reason(device)
            if pdl == "on" and reason:
                raise ConfigError(
                    f"--pdl on: programmatic dependent launch is not available: {reason}")
            pdl_on = pdl != "off" and not reason
        for flag, value in (("--skinny-row-kernel", row_kernel),
                            ("--moe-one-launch", moe_one_launch)):
            if value == "on" and device.type != "cuda":
                raise ConfigError(f"{flag} on needs a CUDA device, not {device}")
        cuda = device.type == "cuda"
        return KernelSwitches(pdl=pdl_on, row_kernel=cuda and row_kernel != "off",
                              fp8_glu=fp8_glu != "off",
                              moe_one_launch=cuda and moe_one_launch != "off")

    @property
    def features(self) -> tuple[str, ...]:
        """The switches that are on, by the names Health's ``kernel_features`` uses."""
        return tuple(name for name, on in (("pdl", self.pdl),
                                           ("skinny_row_kernel", self.row_kernel),
                                           ("fp8_glu", self.fp8_glu),
                                           ("moe_one_launch", self.moe_one_launch)) if on)

    def __enter__(self) -> KernelSwitches:
        if _HELD and _HELD[-1] != self:
            raise RuntimeError(f"kernel switches {_HELD[-1]} are held; cannot nest {self}")
        _HELD.append(self)  # re-entry with equal switches is fine (a forward in a capture)
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 trace: TracebackType | None) -> None:
        _HELD.pop()


#: What launches take outside any executor's forward (direct kernel calls in tests and
#: benchmarks): plain launches, the row kernel, the FP8 gated epilogue and the one-launch
#: MoE decode where they serve.
DEFAULT = KernelSwitches()
_HELD: list[KernelSwitches] = []


def pdl_unsupported_reason(device: torch.device | str) -> str:
    """Why PDL cannot be used on ``device``, or "" where it can: a CUDA device of compute
    capability 9.0 or later, compiled Triton (not its interpreter) with the launch option
    and the ``griddepcontrol`` intrinsics. Imports Triton only for a CUDA device."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"device {device} is not CUDA"
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return "Triton interpreter"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"compute capability {major}.{minor} < 9.0"
    import triton
    import triton.language as tl

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


def active() -> KernelSwitches:
    """The switches a launch takes now: the innermost held ones, else ``DEFAULT``."""
    return _HELD[-1] if _HELD else DEFAULT
