"""The tensor-parallel group of one executor and the collectives its model calls.

Two process groups over the same ranks:

* ``device``: the data plane. NCCL on CUDA, gloo on CPU. The model's all-reduces and the
  logits all-gather run on it, on the device's current stream, so they can be captured in
  CUDA graphs (NCCL >= 2.9 supports capture; every rank must capture the same collectives
  in the same order, which running the same buckets on every rank gives).
* ``control``: gloo over host memory, for start-up and for the step channel's fallback
  transport (``channel.py``: on one host, steps go over Unix sockets). The other ranks'
  timeout on it is unbounded: they wait for the next step however long the scheduler is
  idle (a dead rank 0 closes the sockets, which ends the wait at once). Rank 0's is the
  data plane's: a gloo broadcast's root waits for its receivers, so a hung rank fails
  rank 0's next send within the timeout. Agreements (KV size, captured buckets) run on
  the device group.

The collectives are ``torch.library`` custom ops taking the group by name: Dynamo keeps
each one as a single opaque node (the tc_piecewise backend compiles around it), and the
graph capture backends record whatever kernels it launches. ``TensorParallel.single()``
is the world of one without any process group: its collectives return their input.

All-reduce algorithm: ``all_reduce="nccl"`` runs every all-reduce through NCCL.
``"symm_mem"`` runs those up to ``ONE_SHOT_MAX_BYTES`` (a decode step's activations) as
one kernel over PyTorch symmetric memory (``symm_mem.one_shot_all_reduce_copy_out``):
each rank copies its input into its own registered buffer, the ranks meet at a barrier
on signal pads, each reads every peer's buffer over NVLink (peer-to-peer loads, no
NVLink multicast) and sums, and a closing barrier lets the buffer be reused by the next
call. ``"triton"`` runs the same sizes through our flag kernel
(``executor.kernels.all_reduce``): one barrier per call over two alternating buffers,
and launched with programmatic dependent launch, so the next kernel of the step starts
loading its weights during the all-reduce. ``"lamport"`` runs them through our push
kernel (bf16 and fp16): each rank stores its share straight into every peer's buffer,
whose empty elements read -0.0, and spins on its own buffer until nothing is missing, so
a call crosses NVLink once and needs no flags; it also serves the LM head's all-gather
(``_all_gather``) where a lane holds the logits, and where it takes a one-row
row-parallel projection's all-reduce the projection's skinny GEMM pushes its output
itself and the kernel only sums (``TensorParallel.linear_all_reduce``). Larger inputs,
other dtypes or misaligned ones still go to NCCL, and so does everything when any rank
lacks the op, peer access or the buffer (decided together, so every rank runs the same
collectives). ``"auto"`` (the default) sets every one-shot path up where it can and
times each, and NCCL, inside CUDA graphs at start-up, at ``AUTO_PROBE_BYTES`` (one, 8
and 64 rows of a 4096-wide bf16 activation); each size goes to the fastest on the
slowest rank, and from the first size NCCL wins at, everything larger to NCCL
(``size_plan``; ``all_reduce_choice`` says what was measured and planned). None is
fastest everywhere: one all-reduce of a 4096-wide row inside a graph took 8.1 us through
NCCL and 10.9 through the symm_mem kernel on two H100s
(``bench/results/2026-11-25-h100x2-tensor-parallel``); 12.5, 7.6 and 4.4 (flags) on two
H200s, and 16.2, 11.5 and 7.7 at 64 rows
(``bench/results/2026-11-26-h200x2-triton-all-reduce``); on two H100s NCCL 9.1, symm_mem
9.0, flags 5.5 and push 3.2 us at one row, 12.6, 13.5, 9.5 and 5.9 at 64, so ``auto``
planned the push kernel for every size up to 512 KiB
(``bench/results/2026-11-26-tp-push-all-reduce``).

Fused into the projections (``fuse="on"``; off by default, see below; only where our
kernel takes one-row all-reduces): at decode batch 1 a row-parallel projection (o_proj;
down_proj but the last layer's) and the pre-norm projection after it (gate_up; the next
layer's qkv) are both skinny GEMMs (``executor.kernels.skinny_gemm``). The first then
PUSHes its partial output row into every rank's reduce buffer and flags it there; the
second waits for the flags and GATHERs the sum as its input (float32 in rank order, like
our all-reduce kernel: the same bits, checked on GPUs). No all-reduce kernel runs between
them: ``TensorParallel.push_sum`` returns a ``PendingSum`` that ``RMSNorm.linear_forward``
hands to the next projection. Measured on two H200s it is *slower*: 85 against 75 us per
layer of the 8B shape's four projections and two sums, and the 8B's batch-1 step 3.05
against 2.93 ms (``bench/results/2026-11-26-h200x2-fused-all-reduce``), so it is off
unless asked for (``--tp-fuse-all-reduce on``); the default, ``send``, only lets the
projection before a push-kernel all-reduce store into its buffers (``FuseMode``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from executor.timing import replay_us

# torch >= 2.13 renames all_gather_into_tensor (deprecated there); the GPU hosts run 2.11.
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

if TYPE_CHECKING:
    from executor.kernels.skinny_gemm import ReduceSite

#: Process groups by name, for the custom ops (which cannot take a group object).
_GROUPS: dict[str, dist.ProcessGroup] = {}

#: All-reduces up to this size run as one symmetric-memory kernel ("symm_mem"); a decode
#: step's activation at batch 64 of an 8B model (64 x 4096 x bf16) is 512 KiB.
ONE_SHOT_MAX_BYTES = 512 * 1024
#: What "auto" times both algorithms at: (1, 8, 64) x 4096 bf16, in bytes.
AUTO_PROBE_BYTES = (8 * 1024, 64 * 1024, 512 * 1024)
AllReduceChoice = Literal["auto", "nccl", "symm_mem", "triton", "lamport"]
ALL_REDUCE_CHOICES: tuple[AllReduceChoice, ...] = ("auto", "nccl", "symm_mem", "triton",
                                                   "lamport")
#: The one-shot kernels, in the order "auto" sets them up and times them.
ONE_SHOT_KINDS = ("symm_mem", "triton", "lamport")
#: How far the one-row all-reduces of decode at batch 1 move into the projections
#: (``init``'s ``fuse``, ``--tp-fuse-all-reduce``): "send" (the default) where the push
#: kernel runs them, o_proj/down_proj's GEMM stores its output into its buffers and the
#: kernel only sums (``TensorParallel.linear_all_reduce``); "off" a separate all-reduce
#: after each projection; "on" (experimental, measured slower) where the flag kernel runs
#: them, no all-reduce kernel at all (``push_sum``), and "send" where the push kernel does.
FuseMode = Literal["send", "off", "on"]
FUSE_MODES: tuple[FuseMode, ...] = ("send", "off", "on")


@dataclass(frozen=True)
class _OneShot:
    """A registered symmetric-memory buffer of ``ONE_SHOT_MAX_BYTES`` for one group."""

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


@dataclass(frozen=True)
class _TritonOneShot:
    """``executor.kernels.all_reduce``'s kernel over one registered buffer per rank: the
    same one-shot algorithm as ``_OneShot``, launched with PDL where it is on, so the
    next kernel of the step may start during the all-reduce."""

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
        launcher, grid_size, constexprs = _triton_kernel()
        out = torch.empty_like(x)
        numel = x.numel()
        launcher.launch(
            (grid_size(numel), 1, 1), (x.dtype, numel, self.rank, self.world),
            (x, out, self.bases, self.counters, numel, self.rank, self.slot_bytes),
            {**constexprs, "WORLD": self.world})
        return out


@functools.cache
def _triton_kernel() -> tuple[Any, Callable[[int], int], dict[str, int]]:
    """The kernel's launcher, grid and fixed constexprs, bound once (the module imports
    Triton, which the CPU-only paths of this one never need)."""
    from executor.kernels import all_reduce as kernel
    from executor.kernels.fast_launch import FastLauncher

    return (FastLauncher(kernel.one_shot_all_reduce_kernel, pdl=True, num_warps=4),
            kernel.grid_size, {"FLAGS": kernel.FLAG_BYTES, "BLOCK": kernel.BLOCK})


@dataclass(frozen=True)
class _Lane:
    """One lane of ``_TritonLamport``: a buffer per rank and the counters of its grid."""

    programs: int
    max_bytes: int
    raw: torch.Tensor  # this rank's buffer (two slots of world regions), -0.0 when free
    bases: torch.Tensor  # (world,) int64: every rank's buffer address
    counters: torch.Tensor  # (programs,) int32: calls so far, per program


@dataclass(frozen=True)
class _TritonLamport:
    """``executor.kernels.all_reduce.lamport_all_reduce_kernel``: each rank pushes its
    share into every peer's buffer, where elements not yet arrived read -0.0, so a call
    crosses NVLink once and needs no flags (bf16 and fp16 only: fp32 has no spare bit
    pattern the kernel could spin on cheaply). Its lanes (``LAMPORT_LANES``) launch
    different grids for small and large inputs; every rank picks the same lane by size."""

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
        all-reduce sizes "auto" gave this path. (Not timed against NCCL's on its own: in a
        profiled TP = 2 step on two H100s the logits' all-gather took 8.9 us in NCCL's
        kernel plus a 2.5 us copy-out kernel; this kernel moves 512 KiB all-reduces, the
        same bytes per rank, in about 6 us.)"""
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
        straight into every rank's lane buffer (``skinny_gemm.send_linear``), where an
        all-reduce kernel would first read it back and then push it, and the lane's kernel
        sums what arrived (``SENT``). ``out`` must fit this path (``fits``)."""
        from executor.kernels import skinny_gemm

        lane = self._lane(out)
        skinny_gemm.send_linear(x, weight, skinny_gemm.SendLane(
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
        launcher, block = _lamport_kernel()
        numel = x.numel()
        lane = self._lane(x)
        size = block(numel, lane.programs)
        launcher.launch(
            (lane.programs, 1, 1), (x.dtype, size, self.rank, self.world, gather, sent),
            (x, out, lane.bases, lane.counters, numel, self.rank, lane.max_bytes // 2),
            {"WORLD": self.world, "BLOCK": size, "GATHER": gather, "SENT": sent})


@functools.cache
def _lamport_kernel() -> tuple[Any, Callable[[int, int], int]]:
    """``lamport_all_reduce_kernel``'s launcher and its block per (size, programs)."""
    from executor.kernels import all_reduce as kernel
    from executor.kernels.fast_launch import FastLauncher

    return (FastLauncher(kernel.lamport_all_reduce_kernel, pdl=True, num_warps=4),
            kernel.lamport_block)


OneShotPath = _OneShot | _TritonOneShot | _TritonLamport
#: The one-shot paths of each group that has any, by the same names as ``_GROUPS``, each
#: for its range of sizes (``fits``); an all-reduce no path fits goes to NCCL.
_ONE_SHOT: dict[str, tuple[OneShotPath, ...]] = {}
#: What ``all_reduce_algorithm`` calls each path.
_PATH_NAMES = {_OneShot: "symm_mem_one_shot", _TritonOneShot: "triton_one_shot",
               _TritonLamport: "triton_lamport"}
#: What "auto" measured and chose, per group name (``all_reduce_choice``).
_CHOICES: dict[str, dict[str, object]] = {}


#: Reduce buffers of each group that fuses its one-row all-reduces into the projections:
#: its two sites (a layer's o_proj -> gate_up, then down_proj -> the next qkv).
_FUSED: dict[str, tuple[ReduceSite, ReduceSite]] = {}
#: Groups whose row-parallel projections send their one-row outputs into the push
#: all-reduce (``fuse`` "send" or "on", and a push path set up).
_SENDS: set[str] = set()
#: The widest row a fused site holds, in elements of 2 bytes (hidden sizes up to 16384).
FUSED_MAX_ROW = 16384


@dataclass(frozen=True)
class PendingSum:
    """An all-reduce left to the kernels: every rank's row-parallel projection has pushed
    its partial output row to ``site``; the next pre-norm projection sums them as it
    reads its input (``norm_linear``). It must be consumed exactly once, next, on every
    rank."""

    site: ReduceSite

    def norm_linear(self, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                    layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """``(layer(rms_norm(sum + residual)), sum + residual)``."""
        from executor.kernels import skinny_gemm

        return skinny_gemm.gather_norm_linear(self.site, residual, norm_weight, eps,
                                              layer.weight)  # type: ignore[arg-type]


class CollectiveFailed(RuntimeError):
    """A collective failed: a rank died, hung past the timeout or lost its connection.
    The group cannot step any more (the service treats this as fatal)."""


@contextlib.contextmanager
def collective(what: str) -> Iterator[None]:
    """Turn a backend's failure of collective ``what`` into ``CollectiveFailed``."""
    try:
        yield
    except RuntimeError as exc:  # gloo raises plain RuntimeErrors, NCCL DistErrors
        raise CollectiveFailed(f"tensor-parallel {what} failed: {exc}") from exc


@torch.library.custom_op("model_executor::tp_all_reduce", mutates_args=())
def _all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    for one_shot in _ONE_SHOT.get(group_name, ()):
        if one_shot.fits(x):
            with collective("all-reduce"):
                return one_shot.all_reduce(x)
    out = x.clone()
    with collective("all-reduce"):
        dist.all_reduce(out, group=_GROUPS[group_name])
    return out


@_all_reduce.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("model_executor::tp_all_reduce_", mutates_args=("x",))
def _all_reduce_in_place(x: torch.Tensor, group_name: str) -> None:
    """NCCL's (or gloo's) all-reduce of ``x`` in place: no copy of the input first, which
    in a decode graph was a copy node beside each of a step's 2 x layers + 1 all-reduces."""
    with collective("all-reduce"):
        dist.all_reduce(x, group=_GROUPS[group_name])


@_all_reduce_in_place.register_fake
def _(x: torch.Tensor, group_name: str) -> None:
    return None


@torch.library.custom_op("model_executor::tp_all_gather", mutates_args=())
def _all_gather(x: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    for path in _ONE_SHOT.get(group_name, ()):
        if isinstance(path, _TritonLamport) and path.gathers(x):
            with collective("all-gather"):
                return path.all_gather(x)
    out = x.new_empty((world_size * x.shape[0], *x.shape[1:]))
    with collective("all-gather"):
        _gather_into(out, x.contiguous(), group=_GROUPS[group_name])
    return out


@_all_gather.register_fake
def _(x: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    return x.new_empty((world_size * x.shape[0], *x.shape[1:]))


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in the tensor-parallel group and its two process groups.

    ``distributed`` is False only for ``single()``: a world of one that never calls
    ``torch.distributed``. A world of one *with* process groups (``init``) runs every
    collective for real, which is how one GPU exercises the distributed path.
    """

    rank: int = 0
    size: int = 1
    device_group_name: str | None = None
    control: dist.ProcessGroup | None = field(default=None, compare=False)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    startup: dist.ProcessGroup | None = field(default=None, compare=False)
    #: What bounds this rank's collectives (``init``'s ``timeout``).
    timeout: datetime.timedelta = field(default=datetime.timedelta(minutes=10), compare=False)

    @staticmethod
    def single() -> TensorParallel:
        return TensorParallel()

    @property
    def distributed(self) -> bool:
        return self.device_group_name is not None

    @property
    def leads(self) -> bool:
        """Rank 0: validates, allocates, samples and answers the scheduler."""
        return self.rank == 0

    @property
    def control_group(self) -> dist.ProcessGroup:
        if self.control is None:
            raise RuntimeError("a single-process executor has no control group")
        return self.control

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks. Through NCCL (or gloo) ``x`` is reduced in place and
        returned: callers pass a temporary (a row-parallel projection's output, the
        embedding's) and use only the result. The symmetric-memory path returns a new
        tensor (its kernel reads the input from a registered buffer anyway)."""
        name = self.device_group_name
        if name is None:
            return x
        if name in _ONE_SHOT or not x.is_contiguous():
            return torch.ops.model_executor.tp_all_reduce(x, name)
        torch.ops.model_executor.tp_all_reduce_(x, name)
        return x

    def push_sum(self, x: torch.Tensor, layer: torch.nn.Module, site: int,
                 consumer: torch.nn.Module, norm_weight: torch.Tensor,
                 silu_mul: bool = False) -> PendingSum | None:
        """The all-reduce of ``layer(x)`` (``silu_mul``: of ``layer(silu_and_mul(x))``) left
        to ``consumer``, the pre-norm projection that reads it next (norm weight
        ``norm_weight``): ``layer``'s kernel pushes the partial row to reduce site ``site``
        (0 or 1, alternating) and a ``PendingSum`` is returned. None, with nothing
        launched, where this group does not fuse or either projection is not a one-row
        skinny GEMM here: then all-reduce ``layer(x)`` as usual. Every rank decides alike
        (same shapes, same GPU model)."""
        sites = _FUSED.get(self.device_group_name or "")
        if sites is None:
            return None
        from executor.kernels import skinny_gemm

        if not skinny_gemm.reducible(x, layer, consumer, norm_weight, sites[site], silu_mul):
            return None
        skinny_gemm.push_linear(x, layer.weight, sites[site], silu_mul)  # type: ignore[arg-type]
        return PendingSum(sites[site])

    def linear_all_reduce(self, layer: torch.nn.Module, x: torch.Tensor,
                          compute: Callable[[], torch.Tensor], silu_mul: bool = False,
                          send: bool = True) -> torch.Tensor:
        """``all_reduce(compute())``, where ``compute`` is the row-parallel projection
        ``layer`` of ``x`` (``silu_mul``: of ``silu_and_mul(x)``). With ``send`` (the
        model's kernels are ours), where the push all-reduce takes the output and the
        projection is a one-row skinny GEMM, that GEMM stores its output into the
        all-reduce's buffers itself and one kernel sums what arrived
        (``_TritonLamport.send_all_reduce``); else ``compute`` and ``all_reduce``. Every
        rank decides alike (same shapes, same plan, same GPU model)."""
        name = self.device_group_name
        if send and name in _SENDS and not torch.compiler.is_compiling() and x.is_cuda:
            from executor.kernels import skinny_gemm

            if skinny_gemm.takes(x, layer, silu_mul):
                weight: torch.Tensor = layer.weight  # type: ignore[assignment]
                out = x.new_empty((x.shape[0], weight.shape[0]))
                path = self.push_path(out)
                if path is not None and path.sends(out):
                    with collective("all-reduce"):
                        path.send_all_reduce(x, weight, silu_mul, out)
                    return out
        return self.all_reduce(compute())

    def push_path(self, x: torch.Tensor) -> _TritonLamport | None:
        """The push all-reduce where it is what ``all_reduce(x)`` runs, else None."""
        paths = _ONE_SHOT.get(self.device_group_name or "", ())
        path = next((p for p in paths if p.fits(x)), None)
        return path if isinstance(path, _TritonLamport) else None

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` (R, ...) stacked along dim 0 in rank order: (N * R, ...)."""
        if self.device_group_name is None:
            return x
        return torch.ops.model_executor.tp_all_gather(x, self.device_group_name, self.size)

    def settle(self) -> None:
        """Wait (up to ``STARTUP_TIMEOUT``) until every rank gets here: after start-up
        work whose length differs between ranks (loading weight slices from shared
        storage), so that the data-plane collectives after it, bounded by the much
        shorter collective timeout, do not wait for a slow rank. A rank that dies
        meanwhile is found by the watches of ``launch.py``, not by this wait."""
        if self.startup is not None:
            with collective("start-up barrier"):
                dist.barrier(group=self.startup)

    def min_over_ranks(self, value: int) -> int:
        """The smallest ``value`` over the ranks (a device-group collective, so it is
        bounded by the group's timeout)."""
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        with collective("agreement"):
            dist.all_reduce(t, op=dist.ReduceOp.MIN,
                            group=_GROUPS[self.device_group_name or ""])
        return int(t.item())

    def gather_over_ranks(self, value: int) -> tuple[int, ...]:
        """Every rank's ``value``, in rank order (a device-group collective)."""
        if not self.distributed:
            return (value,)
        out = self.all_gather(torch.tensor([value], dtype=torch.int64, device=self.device))
        return tuple(int(v) for v in out.tolist())


#: How long ``settle`` waits for the slowest rank (loading a large checkpoint's slices).
STARTUP_TIMEOUT = datetime.timedelta(hours=1)
#: The other ranks wait on the control plane for the next step without a bound.
CONTROL_TIMEOUT = datetime.timedelta(days=365)


def init(rank: int, size: int, device: torch.device, store: dist.Store,
         timeout: datetime.timedelta, all_reduce: AllReduceChoice = "auto",
         fuse: FuseMode = "send") -> TensorParallel:
    """Join the default process group over ``store`` and make this rank's two groups.

    ``timeout`` bounds every data-plane collective (a rank that dies or hangs mid-step
    turns into an error on the others within it). A warm-up all-reduce runs on each
    group, so NCCL's communicator exists before any graph captures a collective.
    ``all_reduce`` picks the algorithm (module docstring); ``all_reduce_algorithm``
    says which one this group got. ``fuse`` (``FUSE_MODES``): how far one-row all-reduces
    move into the projections around them.
    """
    if fuse not in FUSE_MODES:
        raise ValueError(f"fuse must be one of {list(FUSE_MODES)}, got {fuse!r}")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                            timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
    world = dist.group.WORLD
    assert world is not None
    # The timeout is each process's own: rank 0's sends are bounded like any collective
    # (a gloo broadcast's root waits for its receivers), the others wait without bound.
    control = dist.new_group(backend="gloo",
                             timeout=timeout if rank == 0 else CONTROL_TIMEOUT)
    # Only for ``settle``: start-up work whose length differs between ranks.
    startup = dist.new_group(backend="gloo", timeout=STARTUP_TIMEOUT)
    name = f"tp{size}-device"
    _GROUPS[name] = world
    tp = TensorParallel(rank, size, name, control, device, startup, timeout)
    probe = tp.all_reduce(torch.ones(1, device=device))
    if int(probe.item()) != size:
        raise RuntimeError(f"warm-up all-reduce gave {probe.item()}, expected {size}")
    _CHOICES[name] = {"asked": all_reduce}
    if all_reduce != "nccl" and device.type == "cuda" and size > 1:
        nccl_us = _probe_us(tp) if all_reduce == "auto" else None
        paths: dict[str, OneShotPath] = {}
        for algo in ONE_SHOT_KINDS:
            if all_reduce in ("auto", algo):
                path = _setup_one_shot(tp, world, algo)
                if path is not None:
                    paths[algo] = path
        if nccl_us is None:
            _ONE_SHOT[name] = tuple(paths.values())
        elif paths:  # "auto": time each path alone, then share the sizes out
            times = {"nccl": nccl_us}
            for algo, path in paths.items():
                _ONE_SHOT[name] = (path,)
                times[algo] = _probe_us(tp)
            _choose(tp, times, paths)
        if not _ONE_SHOT.get(name):
            _ONE_SHOT.pop(name, None)
        if fuse == "on" and any(isinstance(p, _TritonOneShot) and p.min_bytes
                                < AUTO_PROBE_BYTES[0] <= p.max_bytes
                                for p in _ONE_SHOT.get(name, ())):
            _setup_fused(tp, world)
        if fuse != "off" and any(isinstance(p, _TritonLamport)
                                 for p in _ONE_SHOT.get(name, ())):
            _SENDS.add(name)
    _CHOICES[name]["fused_into_projections"] = name in _FUSED
    _CHOICES[name]["projections_send"] = name in _SENDS
    dist.barrier(group=control)
    return tp


def size_plan(sizes: Sequence[int], times_us: Mapping[str, Sequence[float]]
              ) -> list[tuple[str, int]]:
    """"auto"'s plan from probe times by algorithm (``"nccl"`` among them) at ``sizes``
    (ascending, bytes): ``(algorithm, up to bytes)`` ranges of the one-shot algorithms,
    smallest sizes first. At each size the fastest wins, a tie going to NCCL; from the
    first size NCCL wins at, everything larger goes to NCCL (the one-shot kernels read
    every peer's whole input, which scales worst)."""
    plan: list[tuple[str, int]] = []
    for i, size in enumerate(sizes):
        best = min(times_us, key=lambda algo: (times_us[algo][i], algo != "nccl"))
        if best == "nccl":
            break
        if plan and plan[-1][0] == best:
            plan[-1] = (best, size)
        else:
            plan.append((best, size))
    return plan


def _choose(tp: TensorParallel, times_us: dict[str, list[float]],
            paths: dict[str, OneShotPath]) -> None:
    """"auto": share the sizes out by ``size_plan`` of the slowest rank's time for each
    (algorithm, size), so that every rank makes the same plan."""
    name = tp.device_group_name or ""
    algos = list(times_us)
    local = torch.tensor([times_us[a] for a in algos], dtype=torch.float64, device=tp.device)
    with collective("agreement"):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=_GROUPS[name])
    slowest = {a: [float(t) for t in row] for a, row in zip(algos, local.tolist(), strict=True)}
    plan = size_plan(AUTO_PROBE_BYTES, slowest)
    _CHOICES[name].update(probe_bytes=list(AUTO_PROBE_BYTES),
                          **{f"{a}_us": [round(t, 2) for t in times_us[a]] for a in algos},
                          slowest_rank_us=slowest,
                          plan=[{"algorithm": a, "up_to_bytes": b} for a, b in plan])
    lows = [0] + [b for _, b in plan[:-1]]
    _ONE_SHOT[name] = tuple(dataclasses.replace(paths[a], min_bytes=lo, max_bytes=hi)
                            for (a, hi), lo in zip(plan, lows, strict=True))


#: All-reduces per captured graph, and timed replays, of one "auto" probe.
_PROBE_REPEATS, _PROBE_REPLAYS = 16, 12


def _probe_us(tp: TensorParallel) -> list[float]:
    """This rank's median µs of one all-reduce of each ``AUTO_PROBE_BYTES`` through the
    group's current algorithm, inside a CUDA graph (as a decode graph runs them: no launch
    gaps between them, the ranks meeting at each)."""
    times = []
    for nbytes in AUTO_PROBE_BYTES:
        inputs = [torch.zeros(nbytes // 2, dtype=torch.bfloat16, device=tp.device)
                  for _ in range(_PROBE_REPEATS)]
        side = torch.cuda.Stream(tp.device)
        side.wait_stream(torch.cuda.current_stream(tp.device))
        with torch.cuda.stream(side):
            tp.all_reduce(inputs[0])  # warm-up outside the capture
        torch.cuda.current_stream(tp.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for x in inputs:
                tp.all_reduce(x)
        times.append(replay_us(graph, _PROBE_REPEATS, _PROBE_REPLAYS - 2))
        del graph
    return times


def all_reduce_choice(tp: TensorParallel) -> dict[str, object]:
    """What was asked, what runs (``all_reduce_algorithm``), the largest size a one-shot
    kernel takes and, under "auto", this rank's probe times by algorithm and the plan
    made from the slowest rank's."""
    name = tp.device_group_name or ""
    out: dict[str, object] = {"algorithm": all_reduce_algorithm(tp)}
    out.update(_CHOICES.get(name, {}))
    paths = _ONE_SHOT.get(name, ())
    if paths:
        out["one_shot_max_bytes"] = max(p.max_bytes for p in paths)
    return out


def projection_features(tp: TensorParallel) -> tuple[str, ...]:
    """How far this group's one-row all-reduces moved into the projections (what
    ``fuse`` took effect as), as ``ModelInfo.kernel_features`` names them."""
    name = tp.device_group_name or ""
    return (("tp_projections_send",) if name in _SENDS else ()) + (
        ("tp_fused_all_reduce",) if name in _FUSED else ())


def all_reduce_algorithm(tp: TensorParallel) -> str:
    """What this group's small all-reduces run as: "symm_mem_one_shot", "triton_one_shot"
    (or both, smallest sizes first: "triton_one_shot+symm_mem_one_shot"), "nccl", "gloo"
    or "none" (a world without process groups)."""
    if not tp.distributed:
        return "none"
    paths = _ONE_SHOT.get(tp.device_group_name or "", ())
    names = dict.fromkeys(_PATH_NAMES[type(p)] for p in paths)
    if names:
        return "+".join(names)
    return "nccl" if tp.device.type == "cuda" else "gloo"


def _one_shot_possible(device: torch.device, size: int, kind: str = "symm_mem") -> bool:
    """This rank's own view: the op exists (for our kernels, ``triton`` and ``lamport``:
    compiled Triton, a GPU of compute capability 7.0 or later for the acquire/release
    loads and stores, and a power-of-two group of at most ``MAX_WORLD``) and every local
    peer GPU is reachable (a group spread over hosts has no peer access: ``size`` GPUs
    must be visible here)."""
    if kind != "symm_mem":
        from executor.kernels.all_reduce import MAX_WORLD

        if (os.environ.get("TRITON_INTERPRET", "0") == "1" or size > MAX_WORLD
                or size & (size - 1) or torch.cuda.get_device_capability(device)[0] < 7):
            return False
    elif not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out"):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.cuda.device_count() < size:
        return False
    return all(torch.cuda.can_device_access_peer(index, peer)
               for peer in range(torch.cuda.device_count()) if peer != index)


def _setup_one_shot(tp: TensorParallel, world: dist.ProcessGroup, kind: str = "symm_mem"
                    ) -> OneShotPath | None:
    """Register the symmetric buffer of one of ``ONE_SHOT_KINDS`` and check one sum
    through it; every step of the way is agreed over the ranks, so either all of them get
    the path or none does (None)."""
    try:
        ok = _one_shot_possible(tp.device, tp.size, kind)
    except Exception:  # an old torch without symm_mem ops: no attribute, or no CUDA
        ok = False
    if tp.min_over_ranks(int(ok)) != 1:
        return None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before torch 2.8
            with warnings.catch_warnings():  # deprecated (a no-op) in later versions
                warnings.simplefilter("ignore")
                symm_mem.enable_symm_mem_for_group(world.group_name)
        one_shot: OneShotPath
        if kind == "lamport":
            from executor.kernels import all_reduce as kernel

            lanes = []
            for programs, max_bytes in kernel.LAMPORT_LANES:
                raw = symm_mem.empty(kernel.lamport_buffer_bytes(max_bytes, tp.size),
                                     dtype=torch.uint8, device=tp.device)
                raw.view(torch.int16).fill_(kernel.LAMPORT_EMPTY)  # nothing has arrived
                torch.cuda.synchronize(tp.device)
                # collective: no rank pushes into a buffer before its owner marked it empty
                handle = symm_mem.rendezvous(raw, world.group_name)
                lanes.append(_Lane(programs, max_bytes, raw, torch.tensor(
                    list(handle.buffer_ptrs), dtype=torch.int64, device=tp.device),
                    torch.zeros(programs, dtype=torch.int32, device=tp.device)))
            one_shot = _TritonLamport(tuple(lanes), tp.rank, tp.size)
        elif kind == "triton":
            from executor.kernels.all_reduce import MAX_PROGRAMS, buffer_bytes

            raw = symm_mem.empty(buffer_bytes(ONE_SHOT_MAX_BYTES), dtype=torch.uint8,
                                 device=tp.device)
            raw.zero_()  # the arrival flags start at 0 on every rank before any is set
            torch.cuda.synchronize(tp.device)
            # collective: no rank signals into a buffer before its owner has zeroed it
            handle = symm_mem.rendezvous(raw, world.group_name)
            one_shot = _TritonOneShot(
                raw, torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64,
                                  device=tp.device),
                torch.zeros(MAX_PROGRAMS, dtype=torch.int32, device=tp.device),
                tp.rank, tp.size)
        else:
            raw = symm_mem.empty(ONE_SHOT_MAX_BYTES, dtype=torch.uint8, device=tp.device)
            symm_mem.rendezvous(raw, world.group_name)
            one_shot = _OneShot({dt: raw.view(dt) for dt in (torch.bfloat16, torch.float16,
                                                             torch.float32)},
                                world.group_name)
        probe = torch.full((1024,), float(tp.rank + 1), dtype=torch.bfloat16,
                           device=tp.device)
        good = bool((one_shot.all_reduce(probe) == tp.size * (tp.size + 1) / 2).all())
    except Exception:  # rendezvous or the kernel refused: every rank stays on NCCL
        good = False
    return one_shot if tp.min_over_ranks(int(good)) == 1 else None


def _setup_fused(tp: TensorParallel, world: dist.ProcessGroup) -> None:
    """Register the reduce sites' buffer and check a push and a gather at each site three
    times (both slots) against the exact sum; agreed over the ranks (``_FUSED`` holds the
    group's sites only if every rank's check passed)."""
    from executor.kernels import skinny_gemm
    from executor.kernels.skinny_gemm import SITE_FLAG_BYTES, ReduceSite

    slot_bytes = tp.size * FUSED_MAX_ROW * 2
    site_bytes = SITE_FLAG_BYTES + 2 * slot_bytes
    good = False
    try:
        import torch.distributed._symmetric_memory as symm_mem

        raw = symm_mem.empty(2 * site_bytes, dtype=torch.uint8, device=tp.device)
        raw.zero_()  # the flags start at 0 on every rank before any is set
        ctl = torch.zeros(4, dtype=torch.int32, device=tp.device)
        torch.cuda.synchronize(tp.device)
        handle = symm_mem.rendezvous(raw, world.group_name)  # (collective)
        bases = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=tp.device)
        sites = tuple(ReduceSite(bases, ctl[2 * i: 2 * i + 2], tp.rank, tp.size,
                                 i * site_bytes, slot_bytes, raw) for i in range(2))
        n = 256
        eye = torch.eye(n, dtype=torch.bfloat16, device=tp.device)
        ones = torch.ones(n, dtype=torch.bfloat16, device=tp.device)
        good = True
        for call in range(6):  # sites 0, 1, 0, ...: each slot of each site once at least
            x = torch.full((1, n), float(tp.rank + call + 1), dtype=torch.bfloat16,
                           device=tp.device)
            skinny_gemm.push_linear(x, eye, sites[call % 2])
            out, total = skinny_gemm.gather_norm_linear(sites[call % 2], torch.zeros_like(x),
                                                        ones, 1e-6, eye)
            want = tp.size * (tp.size + 1) / 2 + tp.size * call
            good &= bool((total == want).all()) and bool((out == 1).all())
    except Exception as exc:  # rendezvous or a kernel refused: all-reduces as before
        warnings.warn(f"rank {tp.rank}: the fused all-reduce is off: {exc!r}", stacklevel=1)
        good = False
    if tp.min_over_ranks(int(good)) == 1:
        _FUSED[tp.device_group_name or ""] = (sites[0], sites[1])


def shutdown(tp: TensorParallel) -> None:
    """Leave the process groups (best effort: a peer may be gone)."""
    if not tp.distributed or not dist.is_initialized():
        return
    _GROUPS.pop(tp.device_group_name or "", None)
    _ONE_SHOT.pop(tp.device_group_name or "", None)
    _FUSED.pop(tp.device_group_name or "", None)
    _SENDS.discard(tp.device_group_name or "")
    _CHOICES.pop(tp.device_group_name or "", None)
    # Tearing down after a peer died may raise anything.
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
