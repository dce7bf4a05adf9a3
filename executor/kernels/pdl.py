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

Whether launches use it is a process-wide switch read at each launch (``enabled()``; it
is part of the kernel's specialization: the ``USE_PDL`` constexpr and the ``launch_pdl``
option), owned by ``executor.kernels.switches``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from executor.kernels import switches


def enabled() -> bool:
    """Whether kernels launch with PDL now (the ``USE_PDL`` constexpr and ``launch_pdl``)."""
    return switches.active().pdl


def options() -> dict[str, bool]:
    """Launch keyword arguments for a PDL-aware kernel: its ``USE_PDL`` constexpr, and the
    ``launch_pdl`` option when on (the interpreter and older Triton know no such option)."""
    return _ON if switches.active().pdl else _OFF


#: The launch option, passed only when on: the interpreter and older Triton know none.
LAUNCH_OPTION = {"launch_pdl": True}
_ON = {"USE_PDL": True, **LAUNCH_OPTION}
_OFF = {"USE_PDL": False}


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """Step 2 and 3 above: wait for the predecessor grid, then let the successor launch.
    Call it in every program before the first load of step data and the first store."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
