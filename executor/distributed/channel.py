"""Rank 0 to the other ranks: headers and packed steps on the control plane (gloo, host
memory), sampled tokens on the device group (a device tensor, no host round trip).

Every call here is a collective: rank 0 and every other rank make the matching calls in
the same order (``Executor`` on rank 0, ``follower.follow`` elsewhere).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from executor.distributed.group import _GROUPS, TensorParallel, collective
from executor.distributed.protocol import (
    HEADER_LEN,
    CaptureHeader,
    ForkHeader,
    Header,
    ShutdownHeader,
    StepHeader,
    decode,
)


class StepChannel:
    def __init__(self, tp: TensorParallel, device: torch.device) -> None:
        if not tp.distributed:
            raise ValueError("a step channel needs process groups")
        self.tp, self.device = tp, device
        self._control = tp.control_group
        self._device_group = _GROUPS[tp.device_group_name or ""]
        self._header = torch.zeros(HEADER_LEN, dtype=torch.int64)

    # -- rank 0 ---------------------------------------------------------------------------
    def send(self, header: Header, packed: torch.Tensor | None = None) -> None:
        """Broadcast ``header`` and, for a step, its packed host buffer."""
        self._header.copy_(torch.tensor(header.encode(), dtype=torch.int64))
        with collective("step broadcast"):
            dist.broadcast(self._header, src=0, group=self._control)
            if isinstance(header, StepHeader) and header.sizes.total:
                assert packed is not None and packed.numel() >= header.sizes.total
                dist.broadcast(packed[: header.sizes.total].contiguous(), src=0,
                               group=self._control)

    def send_sampled(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Each sampled row's (slot, token) to the other ranks' ``last_tokens``."""
        with collective("sampled-token broadcast"):
            dist.broadcast(torch.stack((slots, tokens)), src=0, group=self._device_group)

    def agree(self, ok: bool) -> bool:
        """True only if every rank says ``ok`` (capture of one bucket)."""
        return self.tp.min_over_ranks(int(ok)) == 1

    # -- other ranks ----------------------------------------------------------------------
    def receive(self) -> tuple[Header, torch.Tensor | None]:
        """The next header and, for a step, its packed host buffer (a new tensor)."""
        with collective("step broadcast"):
            dist.broadcast(self._header, src=0, group=self._control)
        header = decode(self._header.tolist())
        if not isinstance(header, StepHeader) or not header.sizes.total:
            return header, None if not isinstance(header, StepHeader) else \
                torch.empty(0, dtype=torch.int64)
        packed = torch.empty(header.sizes.total, dtype=torch.int64)
        with collective("step broadcast"):
            dist.broadcast(packed, src=0, group=self._control)
        return header, packed

    def receive_sampled(self, rows: int) -> torch.Tensor:
        """(2, rows) int64 on the device: slots, then tokens."""
        out = torch.empty(2, rows, dtype=torch.int64, device=self.device)
        with collective("sampled-token broadcast"):
            dist.broadcast(out, src=0, group=self._device_group)
        return out


__all__ = ["CaptureHeader", "ForkHeader", "ShutdownHeader", "StepChannel", "StepHeader"]
