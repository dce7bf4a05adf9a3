"""The tensor-parallel collectives as ``torch.library`` custom ops, and their groups' state.

Dynamo keeps each op as one opaque node (the tc_piecewise backend compiles around it) and
the graph capture backends record whatever kernels it launches. The ops take the group by
name (a custom op cannot take a process group object), so each group's state lives in one
registry by name: the process group, the one-shot all-reduce paths set up for it (each for
its range of sizes; what no path ``fits`` goes to NCCL or gloo), whether row-parallel
projections send into the push path, and the report of how the algorithm was chosen.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

# torch >= 2.13 renames all_gather_into_tensor (deprecated there).
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class OneShotPath(Protocol):
    """An all-reduce algorithm set up on a group (``all_reduce.paths``): it takes the
    inputs it ``fits`` (its range of sizes, dtypes, alignment); where it ``gathers`` an
    input, it also serves the all-gather."""

    @property
    def name(self) -> str: ...

    @property
    def max_bytes(self) -> int: ...

    @property
    def min_bytes(self) -> int: ...

    def fits(self, x: torch.Tensor) -> bool: ...

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def gathers(self, x: torch.Tensor) -> bool: ...

    def all_gather(self, x: torch.Tensor) -> torch.Tensor: ...


@dataclass
class GroupState:
    """One device group's state, by the name the custom ops take (``TensorParallel``'s
    ``device_group_name``)."""

    group: dist.ProcessGroup
    #: one-shot paths, smallest sizes first; empty: every all-reduce through the backend
    paths: tuple[OneShotPath, ...] = ()
    #: row-parallel projections send their one-row outputs into the push path
    sends: bool = False
    #: what was asked and, under "auto", timed and planned (``auto.all_reduce_choice``)
    report: dict[str, object] = field(default_factory=dict)


_STATES: dict[str, GroupState] = {}


def register(name: str, group: dist.ProcessGroup) -> GroupState:
    """A fresh state for the device group ``name``."""
    _STATES[name] = GroupState(group)
    return _STATES[name]


def state(name: str | None) -> GroupState | None:
    return _STATES.get(name) if name is not None else None


def forget(name: str | None) -> None:
    if name is not None:
        _STATES.pop(name, None)


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
    st = _STATES[group_name]
    for path in st.paths:
        if path.fits(x):
            with collective("all-reduce"):
                return path.all_reduce(x)
    out = x.clone()
    with collective("all-reduce"):
        dist.all_reduce(out, group=st.group)
    return out


@_all_reduce.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("model_executor::tp_all_reduce_", mutates_args=("x",))
def _all_reduce_in_place(x: torch.Tensor, group_name: str) -> None:
    """NCCL's (or gloo's) all-reduce of ``x`` in place: no copy of the input first, which
    in a decode graph was a copy node beside each of a step's 2 x layers + 1 all-reduces."""
    with collective("all-reduce"):
        dist.all_reduce(x, group=_STATES[group_name].group)


@_all_reduce_in_place.register_fake
def _(x: torch.Tensor, group_name: str) -> None:
    return None


@torch.library.custom_op("model_executor::tp_all_gather", mutates_args=())
def _all_gather(x: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    st = _STATES[group_name]
    for path in st.paths:
        if path.gathers(x):
            with collective("all-gather"):
                return path.all_gather(x)
    out = x.new_empty((world_size * x.shape[0], *x.shape[1:]))
    with collective("all-gather"):
        _gather_into(out, x.contiguous(), group=st.group)
    return out


@_all_gather.register_fake
def _(x: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    return x.new_empty((world_size * x.shape[0], *x.shape[1:]))
