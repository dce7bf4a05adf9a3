"""Tensor parallelism over ``torch.distributed``: one executor across N ranks.

    group     the ranks' process groups and the collectives the model calls (custom ops,
              so graph capture and torch.compile see one opaque node each)
    protocol  the fixed-size header that precedes every step sent to the other ranks
    channel   rank 0 -> other ranks: steps (packed int64 buffers), sampled tokens, capture
    spawn     starting the ranks: rendezvous, the spawned processes, heartbeats

This module is the package's face: the service imports these names from here.
"""

from executor.distributed.group import (
    ALL_REDUCE_CHOICES,
    FUSE_MODES,
    CollectiveFailed,
    TensorParallel,
    all_reduce_choice,
    init,
    shutdown,
)
from executor.distributed.spawn import (
    ChildWatch,
    Heartbeat,
    ParallelConfig,
    Rendezvous,
    die_with_parent,
    rank_device,
    spawn_context,
)

__all__ = ["ALL_REDUCE_CHOICES", "FUSE_MODES", "ChildWatch", "CollectiveFailed", "Heartbeat",
           "ParallelConfig", "Rendezvous", "TensorParallel", "all_reduce_choice",
           "die_with_parent", "init", "rank_device", "shutdown", "spawn_context"]
