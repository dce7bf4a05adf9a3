"""The tensor-parallel group of one executor: its ranks, its process groups, and the
collectives its model calls.

Two process groups over the same ranks. ``device`` is the data plane (NCCL on CUDA, gloo on
CPU): the model's all-reduces and the logits' all-gather run on it, on the current stream,
so CUDA graphs capture them; agreements (KV size, captured buckets) run on it too.
``control`` is gloo over host memory, for start-up and the step channel's fallback
transport. ``TensorParallel.single()`` is the world of one without any process group: its
collectives return their input. ``bootstrap.init`` makes the groups; the all-reduce
algorithms are in ``all_reduce/``; ``docs/tensor-parallel.md`` has the whole protocol.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from executor.distributed import collectives
from executor.distributed.all_reduce.paths import PushAllReduce
from executor.distributed.collectives import collective

__all__ = ["TensorParallel", "all_reduce_algorithm", "projection_features"]


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
        embedding's) and use only the result. A one-shot path returns a new tensor (its
        kernel reads the input from a registered buffer anyway)."""
        name = self.device_group_name
        if name is None:
            return x
        st = collectives.state(name)
        if (st is not None and st.paths) or not x.is_contiguous():
            return torch.ops.model_executor.tp_all_reduce(x, name)
        torch.ops.model_executor.tp_all_reduce_(x, name)
        return x

    def linear_all_reduce(self, layer: torch.nn.Module, x: torch.Tensor,
                          compute: Callable[[], torch.Tensor], silu_mul: bool = False,
                          send: bool = True) -> torch.Tensor:
        """``all_reduce(compute())``, where ``compute`` is the row-parallel projection
        ``layer`` of ``x`` (``silu_mul``: of ``silu_and_mul(x)``). With ``send`` (the
        model's kernels are ours), where the push all-reduce takes the output and the
        projection is a one-row skinny GEMM, that GEMM stores its output into the
        all-reduce's buffers itself and one kernel sums what arrived
        (``PushAllReduce.send_all_reduce``); else ``compute`` and ``all_reduce``. Every
        rank decides alike (same shapes, same plan, same GPU model)."""
        st = collectives.state(self.device_group_name)
        if send and st is not None and st.sends and not torch.compiler.is_compiling() \
                and x.is_cuda:
            from executor.kernels import skinny

            if skinny.takes(x, layer, silu_mul):
                weight: torch.Tensor = layer.weight  # type: ignore[assignment]
                out = x.new_empty((x.shape[0], weight.shape[0]))
                path = self.push_path(out)
                if path is not None and path.sends(out):
                    with collective("all-reduce"):
                        path.send_all_reduce(x, weight, silu_mul, out)
                    return out
        return self.all_reduce(compute())

    def push_path(self, x: torch.Tensor) -> PushAllReduce | None:
        """The push all-reduce where it is what ``all_reduce(x)`` runs, else None."""
        st = collectives.state(self.device_group_name)
        path = next((p for p in st.paths if p.fits(x)), None) if st is not None else None
        return path if isinstance(path, PushAllReduce) else None

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` (R, ...) stacked along dim 0 in rank order: (N * R, ...)."""
        if self.device_group_name is None:
            return x
        return torch.ops.model_executor.tp_all_gather(x, self.device_group_name, self.size)

    def settle(self) -> None:
        """Wait (up to ``bootstrap.STARTUP_TIMEOUT``) until every rank gets here: after
        start-up work whose length differs between ranks (loading weight slices from shared
        storage), so that the data-plane collectives after it, bounded by the much
        shorter collective timeout, do not wait for a slow rank. A rank that dies
        meanwhile is found by the watches of ``spawn.py``, not by this wait."""
        if self.startup is not None:
            with collective("start-up barrier"):
                dist.barrier(group=self.startup)

    def min_over_ranks(self, value: int) -> int:
        """The smallest ``value`` over the ranks (a device-group collective, so it is
        bounded by the group's timeout)."""
        if not self.distributed:
            return value
        st = collectives.state(self.device_group_name)
        assert st is not None, "the group has been shut down"
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        with collective("agreement"):
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=st.group)
        return int(t.item())

    def gather_over_ranks(self, value: int) -> tuple[int, ...]:
        """Every rank's ``value``, in rank order (a device-group collective)."""
        if not self.distributed:
            return (value,)
        out = self.all_gather(torch.tensor([value], dtype=torch.int64, device=self.device))
        return tuple(int(v) for v in out.tolist())


def all_reduce_algorithm(tp: TensorParallel) -> str:
    """What this group's small all-reduces run as: the one-shot paths' names, smallest
    sizes first ("push", or "flags+symm_mem" under "auto"), else "nccl", "gloo" on CPU,
    or "none" (a world without process groups)."""
    if not tp.distributed:
        return "none"
    st = collectives.state(tp.device_group_name)
    names = dict.fromkeys(p.name for p in st.paths) if st is not None else {}
    if names:
        return "+".join(names)
    return "nccl" if tp.device.type == "cuda" else "gloo"


def projection_features(tp: TensorParallel) -> tuple[str, ...]:
    """``("tp_projections_send",)`` where this group's row-parallel projections send their
    one-row outputs into the push all-reduce (``ModelInfo.kernel_features``), else ()."""
    st = collectives.state(tp.device_group_name)
    return ("tp_projections_send",) if st is not None and st.sends else ()
