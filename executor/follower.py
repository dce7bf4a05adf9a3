"""The tensor-parallel follower: what a rank other than 0 runs.

Rank 0's ``Executor`` validates, allocates and samples; each step, capture and fork it
runs reaches the other ranks first (``StepChannel``), and each of them runs the same
forward on its shard (``follow_step``), copies the same table rows (``follow_fork``),
captures the same graphs or joins the same weight operation (``WeightControl.follow``),
until rank 0 says to stop (``run``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from executor.distributed.protocol import CaptureHeader, ForkHeader, StepHeader, WeightsHeader

if TYPE_CHECKING:
    from executor.executor import Executor


def run(executor: Executor) -> int:
    """Receive and run rank 0's steps and captures until SHUTDOWN; the steps run.

    Raises whatever a collective raises when a peer dies or a timeout passes: the caller
    logs it and exits (the rank cannot rejoin a group whose step it missed).
    """
    channel = executor.channel
    if channel is None or executor.tp.leads:
        raise ValueError("only a rank other than 0 of a tensor-parallel group follows")
    steps = 0
    while True:
        header, packed = channel.receive()
        if isinstance(header, StepHeader):
            assert packed is not None
            follow_step(executor, header, packed)
            steps += 1
        elif isinstance(header, CaptureHeader):
            executor.capture(header.phases, header.force)
        elif isinstance(header, ForkHeader):
            follow_fork(executor, header)
        elif isinstance(header, WeightsHeader):
            executor.weights.follow()
        else:
            return steps


@torch.inference_mode()
def follow_step(executor: Executor, header: StepHeader, packed: torch.Tensor) -> None:
    """Run the step rank 0 sent: the same batch at the same KV locations, the same
    forward; then take rank 0's sampled tokens."""
    forward, channel = executor.forward, executor.channel
    forward.run(forward.unpack(header, packed), header.mode, header.bucket)
    if channel is not None:
        channel.launched()  # rank 0's confirmation, with our launch time
        if header.sampled:
            executor.last.receive(channel.receive_sampled(header.sampled))  # (2, sequences)


def follow_fork(executor: Executor, header: ForkHeader) -> None:
    """Rank 0 forked a sequence: copy its table row prefix (and last sampled token) the
    same way."""
    executor.table.copy_prefix(header.parent, header.child, header.length)
    if header.inherit:
        executor.last.copy(header.parent, header.child)
