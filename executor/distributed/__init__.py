"""Tensor parallelism over ``torch.distributed``: one executor across N ranks.

    group        ``TensorParallel``: this rank's place, its process groups, the collectives
                 the model calls, and the agreements over the ranks
    collectives  the custom ops (one opaque node each for graph capture and torch.compile)
                 and each group's state, by name
    bootstrap    ``init`` / ``shutdown``: join the groups, set up and plan the all-reduce
    all_reduce/  the all-reduce algorithms (``paths``) and the start-up choice (``auto``)
    protocol     the fixed-size header that precedes every step sent to the other ranks
    channel      rank 0 -> other ranks: steps (packed int64 buffers), sampled tokens, capture
    spawn        starting the ranks: rendezvous, the spawned processes, heartbeats

This module is the package's face: the service imports these names from here.
"""

from executor.distributed.all_reduce.auto import all_reduce_choice
from executor.distributed.all_reduce.paths import ALL_REDUCE_CHOICES
from executor.distributed.bootstrap import init, shutdown
from executor.distributed.collectives import CollectiveFailed
from executor.distributed.group import TensorParallel
from executor.distributed.spawn import (
    GEMM_SEND_MODES,
    LOOPBACK,
    ChildWatch,
    Heartbeat,
    ParallelConfig,
    Rendezvous,
    die_with_parent,
    host_store,
    rank_device,
    spawn_context,
)

__all__ = ["ALL_REDUCE_CHOICES", "GEMM_SEND_MODES", "LOOPBACK", "ChildWatch",
           "CollectiveFailed", "Heartbeat", "ParallelConfig", "Rendezvous", "TensorParallel",
           "all_reduce_choice", "die_with_parent", "host_store", "init", "rank_device",
           "shutdown", "spawn_context"]
