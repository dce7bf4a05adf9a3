"""Launching a compiled Triton kernel without the JIT's per-call argument binding.

``kernel[grid](*args)`` binds and specializes every argument on every call, which for a
kernel with many arguments costs as much host time as the GPU work it launches.
``FastLauncher`` binds once per specialization through the JIT; later calls of the same
specialization go straight to the compiled kernel's launcher with raw device pointers. A
specialization is the caller's *key* plus the 16-byte alignment of every pointer argument
the kernel does not exempt (``do_not_specialize``).

NOTE: the caller's key must hold everything else the JIT specializes on: every tensor's
dtype and every integer argument not in ``do_not_specialize`` (the JIT treats 1 and
multiples of 16 specially). A key that misses one would launch a kernel compiled for other
arguments. Triton older than 3.3, the interpreter, or an installed launch hook (profilers)
send every call through the JIT instead. More in ``docs/kernels.md``.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from executor.kernels import pdl
from executor.kernels.pdl import LAUNCH_OPTION


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints (``triton.cdiv`` costs host time on every call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``), like ``triton.next_power_of_2``
    without its call overhead."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


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


@dataclass
class _Binding:
    """One caller key: where its tensors sit, which of them specialize on alignment, the
    constexpr values in signature order, and a compiled kernel per alignment pattern."""

    tensor_idx: tuple[int, ...]
    align_idx: tuple[int, ...]
    tail: tuple[Any, ...]
    kernels: dict[tuple[bool, ...], Any] = field(default_factory=dict)


class FastLauncher:
    """Launches of one ``@triton.jit`` function, by specialization.

    ``launch(grid, key, args, constexprs)``: ``args`` are the kernel's runtime parameters
    in signature order (tensors, ints, floats), ``constexprs`` its constexpr parameters
    by name. Launch options (``num_warps``, ``num_stages``) are fixed per launcher.

    ``pdl``: the kernel takes a ``USE_PDL`` constexpr (``executor.kernels.pdl``); each launch
    passes it and the ``launch_pdl`` option from ``pdl.enabled()``, and keys on it.
    """

    def __init__(self, fn: Any, pdl: bool = False, **options: int) -> None:
        self.fn = fn
        self.options: dict[str, Any] = dict(options)
        self.pdl = pdl
        self._pdl_options = {False: self.options, True: {**options, **LAUNCH_OPTION}}
        self.interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
        self.enabled = not self.interpreted
        self._bindings: dict[Hashable, _Binding] = {}
        self.fast_launches = 0  # for tests and profiles: how often the fast path ran
        self.disabled_reason = "" if self.enabled else "Triton interpreter"
        self._device = -1  # CUDA device index of the first bound launch

    def _with_pdl(self, key: Hashable, constexprs: dict[str, Any]
                  ) -> tuple[Hashable, dict[str, Any], dict[str, Any]]:
        """The key, constexprs and launch options of a launch now (PDL on or off)."""
        if not self.pdl:
            return key, constexprs, self.options
        on = pdl.enabled()
        return (key, on), {**constexprs, "USE_PDL": on}, self._pdl_options[on]

    def compiled(self, args: Sequence[Any], constexprs: dict[str, Any]) -> Any:
        """The kernel a launch with ``args`` and ``constexprs`` would run now, compiled and
        loaded on the current device without being launched (its ``n_regs``, ``n_spills``
        and ``metadata.shared`` are then known), or None: under the interpreter, or where
        this Triton's ``warmup`` or loading does not take it. The next launch of the same
        specialization finds it in the JIT's cache."""
        if self.interpreted:
            return None
        _, constexprs, options = self._with_pdl(None, constexprs)
        try:
            kernel = self.fn.warmup(*args, grid=(1,), **constexprs, **options)
            kernel._init_handles()
        except Exception:  # an older or newer Triton: the caller keeps its own estimate
            return None
        return kernel if isinstance(getattr(kernel, "n_regs", None), int) else None

    def launch(self, grid: tuple[int, int, int], key: Hashable, args: Sequence[Any],
               constexprs: dict[str, Any]) -> None:
        key, constexprs, options = self._with_pdl(key, constexprs)
        binding = self._bindings.get(key) if self.enabled else None
        if binding is None or _launch_hooks_set():
            compiled = self.fn[grid](*args, **constexprs, **options)
            if self.enabled and binding is None:
                self._bind(key, compiled, args, constexprs)
            return
        values = list(args)
        for i in binding.tensor_idx:
            values[i] = values[i].data_ptr()
        aligned = tuple(values[i] % 16 == 0 for i in binding.align_idx)
        compiled = binding.kernels.get(aligned)
        if compiled is None:  # this alignment pattern: the JIT picks (or compiles) it once
            binding.kernels[aligned] = self.fn[grid](*args, **constexprs, **options)
            return
        stream = _raw_stream(self._device)  # the current stream, as the JIT would take
        compiled.run(grid[0], grid[1], grid[2], stream, compiled.function,
                     compiled.packed_metadata, None, None, None, *values, *binding.tail)
        self.fast_launches += 1

    def _bind(self, key: Hashable, compiled: Any, args: Sequence[Any],
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
        exempt = set(getattr(self.fn, "do_not_specialize", None) or ())
        exempt |= set(getattr(self.fn, "do_not_specialize_on_alignment", None) or ())
        align_idx = tuple(i for i in tensor_idx if i not in exempt and names[i] not in exempt)
        binding = _Binding(tensor_idx, align_idx,
                           tuple(constexprs[name] for name in constexpr_names))
        binding.kernels[tuple(args[i].data_ptr() % 16 == 0 for i in align_idx)] = compiled
        self._bindings[key] = binding

    def _disable(self, reason: str) -> None:
        """Send every later launch through the JIT (this Triton or these arguments do not
        fit the fast path)."""
        self.enabled, self.disabled_reason = False, reason
        self._bindings.clear()


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
