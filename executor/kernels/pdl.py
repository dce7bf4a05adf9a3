# mypy: allow-untyped-defs
# (``@triton.jit`` parameters stay unannotated: Triton reads annotations as type hints.)
"""Programmatic dependent launch (PDL) for our Triton kernels (Hopper and later).

A kernel launched with PDL may start while its predecessor still runs. Each of ours first
does what depends on nothing the step writes (the skinny GEMM loads its first weight
chunk), then waits in every program (``griddepcontrol.wait``, ``pdl_enter``) until the
predecessor grid has completed, then lets its own successor launch
(``griddepcontrol.launch_dependents``).

Rules a PDL kernel must keep, or it races: no load of anything a kernel of the step may
have written, and no store at all, before the wait; every program waits, whatever path it
takes. A kernel may instead wait (``pdl_wait``) and let its successor launch only after
its main loop (``pdl_trigger``), or, a short kernel whose successor has long work before
its own wait, let the successor launch first (``pdl_launch_then_wait``): that successor's
pre-wait part then also runs beside this kernel's predecessor, so it too may read nothing
that predecessor writes. Results are bit-identical with and without PDL. Whether
launches use it is a process-wide switch (``enabled()``, owned by
``executor.kernels.switches``) and part of each kernel's specialization (``USE_PDL``,
``launch_pdl``). See ``docs/kernels.md``.
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


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Step 2 alone, for a kernel that lets its successor launch late (``pdl_trigger``
    after its main loop): a persistent successor's programs then find the SMs this grid's
    programs leave, all of them at once, instead of a part of them parked beside it."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_trigger(USE_PDL: tl.constexpr):
    """Step 3 alone: let the successor launch (once every program has called it or
    exited)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_launch_then_wait(USE_PDL: tl.constexpr):
    """Step 3, then step 2: let the successor launch at once, then wait. For a short kernel
    whose successor's pre-wait work is long (the decode attention's gather of its first KV
    block after the q/k-norm + RoPE kernel; o_proj's first weight block after the decode
    merge, which the split kernel lets launch early in turn): that work overlaps this
    kernel's predecessor instead of this kernel alone."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
