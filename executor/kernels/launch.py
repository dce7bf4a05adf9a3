"""Launching a compiled Triton kernel without the JIT's per-call argument binding.

``kernel[grid](*args)`` binds and specializes every argument on every call (alignment of
each pointer, value classes of each integer), hashes the result into a cache key, then
calls the compiled kernel's C launcher, which asks the driver about every tensor pointer.
For the extend-attention kernel (27 arguments) that is 50-100 us of host time per launch
on the lent H100/H200 hosts, once per layer, between graph segments that take the GPU
about 75 us: the prefill forward waited on the host (2026-11-25 profile, H100: replay
host issue 1.80 ms, GPU span 1.88 ms, 30 us idle after each attention kernel).

``FastLauncher`` does the binding once per *specialization key*, a tuple the caller builds
from everything the JIT specializes on (dtypes, pointer alignment, integer arguments,
constexprs), launching through the JIT that first time; later calls with the same key go
straight to the compiled kernel's launcher with raw device pointers.

NOTE: a key that misses something the JIT specializes on would launch a kernel compiled
for other arguments. Callers put in it every dtype, every pointer's 16-byte alignment and
every integer argument the kernel is not told ``do_not_specialize``.

The fast path needs Triton's launch interface of 3.3 and later (``CompiledKernel.run``
taking every parameter, constexprs included, in signature order); anything unexpected,
Triton's interpreter, or a launch hook installed (profilers such as Proton) sends every
call through the JIT instead.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Sequence
from typing import Any

import torch


def _launch_hooks_set() -> bool:
    """Whether a launch hook would see our launches (the JIT path then runs, which calls
    it with the launch's metadata). Newer Triton keeps an empty ``HookChain`` there."""
    try:
        from triton import knobs
    except ImportError:  # Triton < 3.4: no knobs; the JIT path is always right
        return True
    return any(_active(h) for h in (knobs.runtime.launch_enter_hook,
                                   knobs.runtime.launch_exit_hook))


def _active(hook: Any) -> bool:
    calls = getattr(hook, "calls", None)
    return hook is not None and (not isinstance(calls, list) or bool(calls))


class FastLauncher:
    """Launches of one ``@triton.jit`` function, by specialization key.

    ``launch(grid, key, args, constexprs)``: ``args`` are the kernel's runtime parameters
    in signature order (tensors, ints, floats), ``constexprs`` its constexpr parameters
    by name. Launch options (``num_warps``, ``num_stages``) are fixed per launcher.
    """

    def __init__(self, fn: Any, **options: int) -> None:
        self.fn = fn
        self.options = options
        self.enabled = os.environ.get("TRITON_INTERPRET", "0") != "1"
        # key -> (compiled kernel, indices of tensor arguments, constexpr values in order)
        self._compiled: dict[Hashable, tuple[Any, tuple[int, ...], tuple[Any, ...]]] = {}
        self.fast_launches = 0  # for tests and profiles: how often the fast path ran
        self.disabled_reason = "" if self.enabled else "Triton interpreter"
        self._device = -1  # CUDA device index of the first compiled launch

    def launch(self, grid: tuple[int, int, int], key: Hashable, args: Sequence[Any],
               constexprs: dict[str, Any]) -> None:
        entry = self._compiled.get(key) if self.enabled else None
        if entry is None or _launch_hooks_set():
            compiled = self.fn[grid](*args, **constexprs, **self.options)
            if self.enabled and entry is None:
                self._remember(key, compiled, args, constexprs)
            return
        compiled, tensor_idx, tail = entry
        values = list(args)
        for i in tensor_idx:
            values[i] = values[i].data_ptr()
        stream = _raw_stream(self._device)  # the current stream, as the JIT would take
        compiled.run(grid[0], grid[1], grid[2], stream, compiled.function,
                     compiled.packed_metadata, None, None, None, *values, *tail)
        self.fast_launches += 1

    def _remember(self, key: Hashable, compiled: Any, args: Sequence[Any],
                  constexprs: dict[str, Any]) -> None:
        """Keep ``compiled`` for ``key`` if its launcher takes what we would pass: every
        parameter in signature order, runtime ones first (so constexprs come last)."""
        params = list(getattr(self.fn, "params", ()))
        names = [p.name for p in params]
        runtime_names, constexpr_names = names[: len(args)], names[len(args):]
        tensor_idx = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        index = _cuda_index([args[i] for i in tensor_idx])
        if not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
            self._disable(f"compiled kernel {type(compiled).__name__} has no launcher")
        elif (sorted(constexpr_names) != sorted(constexprs)
              or not all(p.is_constexpr for p in params[len(args):])
              or any(p.is_constexpr for p in params[: len(args)])):
            self._disable(f"parameters {runtime_names} + {constexpr_names} do not match "
                          f"{len(args)} runtime arguments and constexprs {sorted(constexprs)}")
        elif index is None or _raw_stream is None:
            devices = sorted({str(args[i].device) for i in tensor_idx})
            self._disable(f"tensor arguments on {devices}, not one CUDA device")
        elif self._device not in (-1, index):
            # one device per launcher: the stream is looked up by its index
            self._disable(f"launches on CUDA devices {self._device} and {index}")
        if not self.enabled or index is None:
            return
        self._device = index
        self._compiled[key] = (compiled, tensor_idx,
                               tuple(constexprs[name] for name in constexpr_names))

    def _disable(self, reason: str) -> None:
        """Send every later launch through the JIT (this Triton or these arguments do not
        fit the fast path)."""
        self.enabled, self.disabled_reason = False, reason
        self._compiled.clear()


_raw_stream: Any = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _cuda_index(tensors: Sequence[torch.Tensor]) -> int | None:
    """The CUDA device index all ``tensors`` share, or None (none, several, or not CUDA)."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        return None
    device = next(iter(devices))
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def aligned16(*tensors: torch.Tensor) -> tuple[bool, ...]:
    """Whether each tensor's data pointer is 16-byte aligned (what Triton specializes a
    pointer argument on)."""
    return tuple(t.data_ptr() % 16 == 0 for t in tensors)
