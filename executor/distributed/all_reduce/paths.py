"""The one-shot all-reduce algorithms, one class each, registered by name in ``PATHS``.

Each takes the all-reduces up to ``ONE_SHOT_MAX_BYTES`` (a decode step's activations) that
it ``fits``, over one registered symmetric-memory buffer per rank reached by NVLink
peer-to-peer loads and stores; larger inputs, other dtypes and misaligned ones go to NCCL.

    symm_mem  PyTorch's ``one_shot_all_reduce_copy_out``
    flags     our flag kernel (``executor.kernels.all_reduce``), launched with PDL
    push      our push kernel: each rank stores its share into every peer's buffer, whose
              empty elements read -0.0, so a call crosses NVLink once; it also serves the
              logits' all-gather and takes one-row outputs the projection's GEMM sent

``setup`` is agreed over the ranks: every rank gets the path or none does.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from executor.distributed.group import TensorParallel

#: All-reduces up to this size run as one one-shot kernel; a decode step's activation at
#: batch 64 of an 8B model (64 x 4096 x bf16) is 512 KiB.
ONE_SHOT_MAX_BYTES = 512 * 1024


class AllReducePath:
    """What every algorithm shares: its ``name``, its range of sizes, and the agreed
    set-up (``setup``) around its own ``_possible`` check and ``_register`` step."""

    name: ClassVar[str]
    max_bytes: int
    min_bytes: int

    def fits(self, x: torch.Tensor) -> bool:
        raise NotImplementedError

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def gathers(self, x: torch.Tensor) -> bool:
        """Whether ``all_gather`` takes ``x`` (only the push path's lanes do)."""
        return False

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"the {self.name} path does not all-gather")

    @classmethod
    def possible(cls, device: torch.device, size: int) -> bool:
        """This rank's own view: the op exists and every local peer GPU is reachable (a
        group spread over hosts has no peer access: ``size`` GPUs must be visible here)."""
        if not cls._possible(device, size):
            return False
        index = device.index if device.index is not None else torch.cuda.current_device()
        if torch.cuda.device_count() < size:
            return False
        return all(torch.cuda.can_device_access_peer(index, peer)
                   for peer in range(torch.cuda.device_count()) if peer != index)

    @classmethod
    def _possible(cls, device: torch.device, size: int) -> bool:
        raise NotImplementedError

    @classmethod
    def _register(cls, tp: TensorParallel, world: dist.ProcessGroup, symm_mem: Any
                  ) -> AllReducePath:
        raise NotImplementedError

    @classmethod
    def setup(cls, tp: TensorParallel, world: dist.ProcessGroup) -> AllReducePath | None:
        """Register this algorithm's symmetric buffer and check one sum through it; every
        step of the way is agreed over the ranks, so either all of them get the path or
        none does (None)."""
        try:
            ok = cls.possible(tp.device, tp.size)
        except Exception:  # an old torch without symm_mem ops: no attribute, or no CUDA
            ok = False
        if tp.min_over_ranks(int(ok)) != 1:
            return None
        path: AllReducePath | None = None
        try:
            import torch.distributed._symmetric_memory as symm_mem

            if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before torch 2.8
                with warnings.catch_warnings():  # deprecated (a no-op) in later versions
                    warnings.simplefilter("ignore")
                    symm_mem.enable_symm_mem_for_group(world.group_name)
            path = cls._register(tp, world, symm_mem)
            probe = torch.full((1024,), float(tp.rank + 1), dtype=torch.bfloat16,
                               device=tp.device)
            good = bool((path.all_reduce(probe) == tp.size * (tp.size + 1) / 2).all())
        except Exception:  # rendezvous or the kernel refused: every rank stays on NCCL
            good = False
        return path if tp.min_over_ranks(int(good)) == 1 else None

    def sized(self, min_bytes: int, max_bytes: int) -> AllReducePath:
        """This path for the sizes in ``(min_bytes, max_bytes]`` ("auto"'s plan)."""
        sized = dataclasses.replace(cast(Any, self), min_bytes=min_bytes, max_bytes=max_bytes)
        return cast(AllReducePath, sized)


def _our_kernel_possible(device: torch.device, size: int) -> bool:
    """Our kernels need compiled Triton, a GPU of compute capability 7.0 or later (for the
    acquire/release loads and stores) and a power-of-two group of at most ``MAX_WORLD``."""
    from executor.kernels.all_reduce import MAX_WORLD

    return not (os.environ.get("TRITON_INTERPRET", "0") == "1" or size > MAX_WORLD
                or size & (size - 1) or torch.cuda.get_device_capability(device)[0] < 7)


@dataclass(frozen=True)
class SymmMemAllReduce(AllReducePath):
    """PyTorch's symmetric-memory one-shot all-reduce: each rank copies its input into its
    registered buffer, the ranks meet at a barrier on signal pads, each reads every peer's
    buffer and sums, and a closing barrier frees the buffer for the next call."""

    name: ClassVar[str] = "symm_mem"
    buffers: dict[torch.dtype, torch.Tensor]  # flat views of one allocation, per dtype
    symm_group: str  # the process group's own name, which symm_mem looks up
    max_bytes: int = ONE_SHOT_MAX_BYTES  # larger all-reduces go to NCCL
    min_bytes: int = 0  # ("auto") sizes up to this one take another path

    def fits(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return (x.dtype in self.buffers and x.is_cuda and x.is_contiguous()
                and self.min_bytes < nbytes <= self.max_bytes and nbytes % 16 == 0
                and x.data_ptr() % 16 == 0)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        flat = x.view(-1)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(
            self.buffers[x.dtype][: flat.numel()], flat, "sum", self.symm_group, out.view(-1))
        return out

    @classmethod
    def _possible(cls, device: torch.device, size: int) -> bool:
        return hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out")

    @classmethod
    def _register(cls, tp: TensorParallel, world: dist.ProcessGroup, symm_mem: Any
                  ) -> AllReducePath:
        raw = symm_mem.empty(ONE_SHOT_MAX_BYTES, dtype=torch.uint8, device=tp.device)
        symm_mem.rendezvous(raw, world.group_name)
        return cls({dt: raw.view(dt) for dt in (torch.bfloat16, torch.float16, torch.float32)},
                   world.group_name)


@dataclass(frozen=True)
class FlagAllReduce(AllReducePath):
    """``executor.kernels.all_reduce``'s flag kernel over one registered buffer per rank:
    one barrier per call over two alternating data slots, launched with PDL where it is
    on, so the next kernel of the step may start during the all-reduce."""

    name: ClassVar[str] = "flags"
    raw: torch.Tensor  # this rank's symmetric buffer (flags, then two data slots)
    bases: torch.Tensor  # (world,) int64: every rank's buffer address
    counters: torch.Tensor  # (MAX_PROGRAMS,) int32: calls so far, per program
    rank: int
    world: int
    slot_bytes: int = ONE_SHOT_MAX_BYTES
    max_bytes: int = ONE_SHOT_MAX_BYTES
    min_bytes: int = 0

    def fits(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return (x.dtype in (torch.bfloat16, torch.float16, torch.float32) and x.is_cuda
                and x.is_contiguous() and self.min_bytes < nbytes <= self.max_bytes
                and x.data_ptr() % 16 == 0)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        launcher, grid_size, constexprs = _flag_kernel()
        out = torch.empty_like(x)
        numel = x.numel()
        launcher.launch(
            (grid_size(numel), 1, 1), (x.dtype, numel, self.rank, self.world),
            (x, out, self.bases, self.counters, numel, self.rank, self.slot_bytes),
            {**constexprs, "WORLD": self.world})
        return out

    @classmethod
    def _possible(cls, device: torch.device, size: int) -> bool:
        return _our_kernel_possible(device, size)

    @classmethod
    def _register(cls, tp: TensorParallel, world: dist.ProcessGroup, symm_mem: Any
                  ) -> AllReducePath:
        from executor.kernels.all_reduce import MAX_PROGRAMS, buffer_bytes

        raw = symm_mem.empty(buffer_bytes(ONE_SHOT_MAX_BYTES), dtype=torch.uint8,
                             device=tp.device)
        raw.zero_()  # the arrival flags start at 0 on every rank before any is set
        torch.cuda.synchronize(tp.device)
        # collective: no rank signals into a buffer before its owner has zeroed it
        handle = symm_mem.rendezvous(raw, world.group_name)
        return cls(raw, torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64,
                                     device=tp.device),
                   torch.zeros(MAX_PROGRAMS, dtype=torch.int32, device=tp.device),
                   tp.rank, tp.size)


@functools.cache
def _flag_kernel() -> tuple[Any, Callable[[int], int], dict[str, int]]:
    """The flag kernel's launcher, grid and fixed constexprs, bound once (the module
    imports Triton, which the CPU-only paths never need)."""
    from executor.kernels import all_reduce as kernel
    from executor.kernels.fast_launch import FastLauncher

    return (FastLauncher(kernel.one_shot_all_reduce_kernel, pdl=True, num_warps=4),
            kernel.grid_size, {"FLAGS": kernel.FLAG_BYTES, "BLOCK": kernel.BLOCK})


@dataclass(frozen=True)
class _Lane:
    """One lane of ``PushAllReduce``: a buffer per rank and the counters of its grid."""

    programs: int
    max_bytes: int
    raw: torch.Tensor  # this rank's buffer (two slots of world regions), -0.0 when free
    bases: torch.Tensor  # (world,) int64: every rank's buffer address
    counters: torch.Tensor  # (programs,) int32: calls so far, per program


@dataclass(frozen=True)
class PushAllReduce(AllReducePath):
    """``executor.kernels.all_reduce.push_all_reduce_kernel``: each rank pushes its
    share into every peer's buffer, where elements not yet arrived read -0.0, so a call
    crosses NVLink once and needs no flags (bf16 and fp16 only: fp32 has no spare bit
    pattern the kernel could spin on cheaply). Its lanes (``LAMPORT_LANES``) launch
    different grids for small and large inputs; every rank picks the same lane by size."""

    name: ClassVar[str] = "push"
    lanes: tuple[_Lane, ...]
    rank: int
    world: int
    max_bytes: int = ONE_SHOT_MAX_BYTES
    min_bytes: int = 0

    def fits(self, x: torch.Tensor) -> bool:
        return self._holds(x) and self.min_bytes < x.numel() * x.element_size() <= self.max_bytes

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        self._launch(x, out, gather=False)
        return out

    def gathers(self, x: torch.Tensor) -> bool:
        """Whether ``all_gather`` takes ``x``: what a lane holds, whatever range of
        all-reduce sizes "auto" gave this path."""
        return self._holds(x) and x.numel() > 0

    def _holds(self, x: torch.Tensor) -> bool:
        """The kernel can take ``x`` at all: bf16/fp16, on CUDA, contiguous, aligned, and
        small enough for the largest lane."""
        return (x.dtype in (torch.bfloat16, torch.float16) and x.is_cuda
                and x.is_contiguous() and x.data_ptr() % 16 == 0
                and x.numel() * x.element_size() <= self.lanes[-1].max_bytes)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` (R, ...) stacked along dim 0 in rank order."""
        out = x.new_empty((self.world * x.shape[0], *x.shape[1:]))
        self._launch(x, out, gather=True)
        return out

    def send_all_reduce(self, x: torch.Tensor, weight: torch.Tensor, silu_mul: bool,
                        out: torch.Tensor) -> None:
        """``out`` = the sum over ranks of ``x @ weight.T`` (``silu_mul``: of
        ``silu_and_mul(x)``), one row, in two launches: the skinny GEMM stores its output
        straight into every rank's lane buffer (``skinny.send_linear``), where an
        all-reduce kernel would first read it back and then push it, and the lane's kernel
        sums what arrived (``SENT``). ``out`` must fit this path (``fits``)."""
        from executor.kernels import skinny

        lane = self._lane(out)
        skinny.send_linear(x, weight, skinny.SendLane(
            lane.bases, lane.counters, self.rank, self.world, lane.max_bytes // 2), silu_mul)
        self._launch(out, out, gather=False, sent=True)

    def sends(self, out: torch.Tensor) -> bool:
        """Whether ``send_all_reduce`` takes an all-reduce into ``out`` (which ``fits``):
        one block per program of its lane (``all_reduce.sent_fits``; any one-row output
        of a model up to 16384 wide)."""
        from executor.kernels import all_reduce as kernel

        return kernel.sent_fits(out.numel(), self._lane(out).programs)

    def _lane(self, x: torch.Tensor) -> _Lane:
        nbytes = x.numel() * x.element_size()
        return next(lane for lane in self.lanes if nbytes <= lane.max_bytes)

    def _launch(self, x: torch.Tensor, out: torch.Tensor, gather: bool,
                sent: bool = False) -> None:
        launcher, block = _push_kernel()
        numel = x.numel()
        lane = self._lane(x)
        size = block(numel, lane.programs)
        launcher.launch(
            (lane.programs, 1, 1), (x.dtype, size, self.rank, self.world, gather, sent),
            (x, out, lane.bases, lane.counters, numel, self.rank, lane.max_bytes // 2),
            {"WORLD": self.world, "BLOCK": size, "GATHER": gather, "SENT": sent})

    @classmethod
    def _possible(cls, device: torch.device, size: int) -> bool:
        return _our_kernel_possible(device, size)

    @classmethod
    def _register(cls, tp: TensorParallel, world: dist.ProcessGroup, symm_mem: Any
                  ) -> AllReducePath:
        from executor.kernels import all_reduce as kernel

        lanes = []
        for programs, max_bytes in kernel.LAMPORT_LANES:
            raw = symm_mem.empty(kernel.push_buffer_bytes(max_bytes, tp.size),
                                 dtype=torch.uint8, device=tp.device)
            raw.view(torch.int16).fill_(kernel.LAMPORT_EMPTY)  # nothing has arrived
            torch.cuda.synchronize(tp.device)
            # collective: no rank pushes into a buffer before its owner marked it empty
            handle = symm_mem.rendezvous(raw, world.group_name)
            lanes.append(_Lane(programs, max_bytes, raw, torch.tensor(
                list(handle.buffer_ptrs), dtype=torch.int64, device=tp.device),
                torch.zeros(programs, dtype=torch.int32, device=tp.device)))
        return cls(tuple(lanes), tp.rank, tp.size)


@functools.cache
def _push_kernel() -> tuple[Any, Callable[[int, int], int]]:
    """The push kernel's launcher and its block per (size, programs)."""
    from executor.kernels import all_reduce as kernel
    from executor.kernels.fast_launch import FastLauncher

    return (FastLauncher(kernel.push_all_reduce_kernel, pdl=True, num_warps=4),
            kernel.push_block)


#: The one-shot algorithms by name, in the order "auto" sets them up and times them.
PATHS: dict[str, type[AllReducePath]] = {cls.name: cls for cls in
                                 (SymmMemAllReduce, FlagAllReduce, PushAllReduce)}
#: ``--tp-all-reduce``: "auto" (each size to the fastest, timed at start-up), "nccl"
#: (everything through NCCL), or one of ``PATHS``.
ALL_REDUCE_CHOICES: tuple[str, ...] = ("auto", "nccl", *PATHS)
