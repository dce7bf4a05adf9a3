"""The loop of a rank other than 0: run what rank 0 sends until it says to stop."""

from __future__ import annotations

from typing import TYPE_CHECKING

from executor.distributed.protocol import CaptureHeader, ForkHeader, StepHeader

if TYPE_CHECKING:
    from executor.executor import Executor


def follow(executor: Executor) -> int:
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
            executor.follow(header, packed)
            steps += 1
        elif isinstance(header, CaptureHeader):
            executor.capture(header.phases, header.force)
        elif isinstance(header, ForkHeader):
            executor.follow_fork(header)
        else:
            return steps
