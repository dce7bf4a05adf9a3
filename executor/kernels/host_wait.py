# mypy: allow-untyped-defs
# (``@triton.jit`` parameters stay unannotated: Triton reads annotations as type hints.)
"""``wait_for_ticket``: the device stream waits until a host counter reaches a value.

One program polls an int64 in pinned host memory (mapped into the device's address space:
a pinned allocation is device-accessible at the same address under unified addressing)
with volatile loads until it holds at least ``ticket``. Work queued after it on the stream
starts once the host has written the counter, so the host can queue a step's sampling
before the data it reads (copied from pinned buffers written before the counter) exists.
A bound on the polls keeps a host that never writes from hanging the device for good.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Polls before the wait gives up (each a read across the host link: about a minute).
MAX_POLLS = 1 << 26


@triton.jit
def _wait_kernel(counter_ptr, ticket, max_polls):
    seen = tl.load(counter_ptr, volatile=True)
    polls = 0
    while (seen < ticket) & (polls < max_polls):
        seen = tl.load(counter_ptr, volatile=True)
        polls += 1


def wait_for_ticket(counter: torch.Tensor, ticket: int) -> None:
    """Queue, on the current stream, a wait until ``counter[0] >= ticket`` (``counter``: a
    pinned int64 host tensor)."""
    assert counter.is_pinned() and counter.dtype == torch.int64
    _wait_kernel[(1,)](counter, ticket, MAX_POLLS, num_warps=1)
