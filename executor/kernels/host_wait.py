# mypy: allow-untyped-defs
# (``@triton.jit`` parameters stay unannotated: Triton reads annotations as type hints.)
"""``wait_for_ticket``: the device stream waits until a host counter reaches a value.

The counter is an int32 in pinned host memory (device-accessible at the same address under
unified addressing), compared wrap-safe: reached when ``counter - ticket`` (int32) >= 0.
The wait is the driver's stream memory operation (``cuStreamWaitValue32``, GEQ: queued in
microseconds, nothing runs on the device meanwhile), else one program polling the counter
with volatile loads (a bound on its polls keeps a host that never writes from hanging the
device for good). Work queued after it on the stream starts once the host has written the
counter, so the host can queue a step's sampling before the data it reads exists.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

#: Polls before the polling wait gives up (each a read across the host link: ~a minute).
MAX_POLLS = 1 << 26
_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ


@triton.jit
def _wait_kernel(counter_ptr, ticket, max_polls):
    seen = tl.load(counter_ptr, volatile=True)
    polls = 0
    while ((seen - ticket) < 0) & (polls < max_polls):
        seen = tl.load(counter_ptr, volatile=True)
        polls += 1


@functools.cache
def _driver_wait() -> Callable[..., int] | None:
    """libcuda's ``cuStreamWaitValue32`` (the current ABI's symbol), or None."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    for name in ("cuStreamWaitValue32_v2", "cuStreamWaitValue32"):
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int
            return fn  # type: ignore[no-any-return]
    return None


_use_driver = True  # cleared at the first refusal: the polling kernel from then on


def wait_for_ticket(counter: torch.Tensor, ticket: int) -> None:
    """Queue, on the current stream, a wait until ``counter[0]`` reaches ``ticket``
    (``counter``: a pinned int32 host tensor; ``ticket`` taken modulo 2**32)."""
    global _use_driver
    assert counter.is_pinned() and counter.dtype == torch.int32
    value = ticket & 0xFFFFFFFF
    fn = _driver_wait() if _use_driver else None
    if fn is not None:
        stream = torch.cuda.current_stream().cuda_stream
        if fn(stream, counter.data_ptr(), value, _GEQ) == 0:
            return
        _use_driver = False
    signed = value - (1 << 32) if value >= 1 << 31 else value
    _wait_kernel[(1,)](counter, signed, MAX_POLLS, num_warps=1)
