"""Joining and leaving the tensor-parallel group: ``init`` and ``shutdown``.

``init`` joins the default process group over a store, makes the control and start-up
groups, warms the data plane up (so NCCL's communicator exists before any graph captures
a collective), then sets up the asked all-reduce algorithm (``all_reduce/``) and, under
"auto", times and plans them. Every decision is agreed over the ranks, so every rank runs
the same collectives.
"""

from __future__ import annotations

import contextlib
import datetime
import threading

import torch
import torch.distributed as dist

from executor.distributed import collectives
from executor.distributed.all_reduce import auto
from executor.distributed.all_reduce.paths import (
    ALL_REDUCE_CHOICES,
    PATHS,
    AllReducePath,
    PushAllReduce,
)
from executor.distributed.group import TensorParallel

#: How long ``settle`` waits for the slowest rank (loading a large checkpoint's slices).
STARTUP_TIMEOUT = datetime.timedelta(hours=1)
#: The other ranks wait on the control plane for the next step without a bound.
CONTROL_TIMEOUT = datetime.timedelta(days=365)
#: How long ``shutdown`` waits for the teardown: a clean one takes well under a second;
#: past this a peer or a communicator is stuck, and the process must still exit.
TEARDOWN_TIMEOUT_S = 10.0


def init(rank: int, size: int, device: torch.device, store: dist.Store,
         timeout: datetime.timedelta, all_reduce: str = "auto",
         gemm_send: bool = True) -> TensorParallel:
    """Join the default process group over ``store`` and make this rank's groups.

    ``timeout`` bounds every data-plane collective (a rank that dies or hangs mid-step
    turns into an error on the others within it). ``all_reduce`` (``ALL_REDUCE_CHOICES``)
    picks the algorithm; ``group.all_reduce_algorithm`` says which one this group got.
    ``gemm_send``: where the push path takes a one-row all-reduce, the row-parallel
    projection's GEMM stores its output into the path's buffers and the kernel only sums.
    """
    if all_reduce not in ALL_REDUCE_CHOICES:
        raise ValueError(f"all_reduce must be one of {list(ALL_REDUCE_CHOICES)}, "
                         f"got {all_reduce!r}")
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
    st = collectives.register(name, world)
    tp = TensorParallel(rank, size, name, control, device, startup, timeout)
    probe = tp.all_reduce(torch.ones(1, device=device))
    if int(probe.item()) != size:
        raise RuntimeError(f"warm-up all-reduce gave {probe.item()}, expected {size}")
    st.report["asked"] = all_reduce
    if all_reduce != "nccl" and device.type == "cuda" and size > 1:
        nccl_us = auto.probe_us(tp) if all_reduce == "auto" else None
        paths: dict[str, AllReducePath] = {}
        for algo, cls in PATHS.items():
            if all_reduce in ("auto", algo):
                path = cls.setup(tp, world)
                if path is not None:
                    paths[algo] = path
        if nccl_us is None:
            st.paths = tuple(paths.values())
        elif paths:  # "auto": time each path alone, then share the sizes out
            st.paths = auto.choose(tp, nccl_us, paths)
        st.sends = gemm_send and any(isinstance(p, PushAllReduce) for p in st.paths)
    st.report["projections_send"] = st.sends
    dist.barrier(group=control)
    return tp


def shutdown(tp: TensorParallel, timeout_s: float = TEARDOWN_TIMEOUT_S) -> bool:
    """Leave the process groups, in the same order on every rank, waiting at most
    ``timeout_s``; True when the teardown finished, False when it did not in time.

    Order: this rank's device work finished; a barrier on the control group (gloo), so no
    rank destroys a communicator a peer may still be using; the all-reduce paths' buffers
    dropped; the gloo groups destroyed; then the default (device: NCCL on CUDA) group.
    It runs on a daemon thread: a teardown blocked on a peer that is gone, or inside
    NCCL, is left behind, and the caller exits the process (``os._exit``) instead of
    waiting for it. Errors are swallowed: a peer may be gone.
    """
    if not tp.distributed or not dist.is_initialized():
        return True
    done = threading.Event()

    def teardown() -> None:
        try:
            if tp.device.type == "cuda":
                with contextlib.suppress(Exception):
                    torch.cuda.set_device(tp.device)  # a new thread starts on device 0
                    torch.cuda.synchronize(tp.device)  # no kernel left on a communicator
            with contextlib.suppress(Exception):
                dist.barrier(group=tp.control)
            collectives.forget(tp.device_group_name)
            for group in (tp.startup, tp.control):
                if group is not None:
                    with contextlib.suppress(Exception):
                        dist.destroy_process_group(group)
            # Tearing down after a peer died may raise anything.
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        finally:
            done.set()

    threading.Thread(target=teardown, name="tp-teardown", daemon=True).start()
    return done.wait(timeout_s)
