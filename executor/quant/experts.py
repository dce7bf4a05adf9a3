"""FP8 experts: a sparse layer's stacked expert weights in e4m3, with their scales.

``Fp8Experts`` holds what ``executor.model.moe.Experts`` holds, ``gate_up_proj`` (E, 2I, H)
and ``down_proj`` (E, H, I), in e4m3, plus float32 scales: per 128x128 block
(``gate_up_scale`` (E, 2I/128, ceil(H/128)), ``down_scale`` (E, ceil(H/128), I/128)), or per
output row (``gate_up_scale`` (E, 2I), ``down_scale`` (E, H); per-tensor checkpoints
repeat each tensor's scale over its rows, exactly). The checkpoint's per-expert weights
load through ``weights/experts.py`` like unquantized ones; ``load_scale`` takes their
scale tensors (this rank's rows of gate/up, columns of down). The experts multiply in
w8a16 (the fused MoE kernels dequantize in registers), so a static ``input_scale`` is read
past. ``to_experts``: the dequantized module, for devices without FP8 kernels.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from executor.errors import ConfigError
from executor.quant.fp8 import FP8, dequantize, quantize_rows
from executor.quant.linear import FixedDtypes, copy_split
from executor.quant.scheme import Fp8Scheme


class Fp8Experts(FixedDtypes):
    """``num_experts`` SwiGLU experts of width ``inter`` (this rank's) in e4m3."""

    def __init__(self, num_experts: int, inter: int, hidden: int, scheme: Fp8Scheme) -> None:
        super().__init__()
        self.scheme = scheme
        self.block = scheme.block
        e = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * inter, hidden, dtype=FP8),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, hidden, inter, dtype=FP8),
                                      requires_grad=False)
        if self.block is not None:
            bn, bk = self.block
            up_shape: tuple[int, ...] = (e, 2 * inter // bn, -(-hidden // bk))
            down_shape: tuple[int, ...] = (e, -(-hidden // bn), inter // bk)
        else:
            up_shape, down_shape = (e, 2 * inter), (e, hidden)
        self.gate_up_scale = nn.Parameter(torch.empty(up_shape), requires_grad=False)
        self.down_scale = nn.Parameter(torch.empty(down_shape), requires_grad=False)

    @property
    def inter(self) -> int:
        return int(self.down_proj.shape[2])

    def kernel_args(self) -> dict[str, Any]:
        """The fused MoE kernels' FP8 arguments (``kernels.moe.fused.fused_moe``)."""
        return {"w13_scale": self.gate_up_scale, "w2_scale": self.down_scale,
                "block": self.block}

    # -- loading --------------------------------------------------------------------
    def load_scale(self, reader: Any, hf_name: str, expert: int, part: int | None, rank: int,
                   size: int, where: str) -> None:
        """Copy this rank's part of expert ``expert``'s scale tensor ``hf_name`` (``part``:
        0 gate, 1 up, None down) into place."""
        width = self.inter
        if part is None:  # down: (H, I), this rank's I columns
            target = self.down_scale[expert]
            if self.block is not None:
                copy_split(reader, hf_name, target, 1, rank, size, where)
            elif self.scheme.kind == "fp8_per_channel":
                copy_split(reader, hf_name, target, None, rank, size, where)
            else:  # one scale for the tensor, repeated over its rows
                copy_split(reader, hf_name, target[:1], None, rank, size, where)
                target.copy_(target[:1].expand_as(target))
            return
        if self.block is not None:
            rows = width // self.block[0]
            target = self.gate_up_scale[expert, part * rows : (part + 1) * rows]
            copy_split(reader, hf_name, target, 0, rank, size, where)
            return
        target = self.gate_up_scale[expert, part * width : (part + 1) * width]
        if self.scheme.kind == "fp8_per_channel":
            copy_split(reader, hf_name, target, 0, rank, size, where)
        else:
            copy_split(reader, hf_name, target[:1], None, rank, size, where)
            target.copy_(target[:1].expand_as(target))

    # -- what a device without the FP8 kernels serves ---------------------------------
    def dense(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights dequantized to ``dtype``: ``(gate_up (E, 2I, H), down (E, H, I))``."""
        def one(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
            if self.block is not None:
                return dequantize(w, s, self.block, dtype)
            return dequantize(w, s.reshape(-1, 1), None, dtype)

        return (torch.stack([one(w, s) for w, s in zip(self.gate_up_proj, self.gate_up_scale,
                                                        strict=True)]),
                torch.stack([one(w, s) for w, s in zip(self.down_proj, self.down_scale,
                                                        strict=True)]))

    def to_experts(self, dtype: torch.dtype) -> nn.Module:
        """An ``executor.model.moe.Experts`` of the dequantized weights in ``dtype``."""
        from executor.model.moe import Experts

        gate_up, down = self.dense(dtype)
        with torch.device("meta"):
            out = Experts(gate_up.shape[0], self.inter, gate_up.shape[2])
        out.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
        out.down_proj = nn.Parameter(down, requires_grad=False)
        return out

    @staticmethod
    def quantize(experts: nn.Module, scheme: Fp8Scheme) -> Fp8Experts:
        """``--quantization fp8``: ``experts``' weights quantized per output row."""
        w13: torch.Tensor = experts.gate_up_proj  # type: ignore[assignment]
        w2: torch.Tensor = experts.down_proj  # type: ignore[assignment]
        with torch.device("meta"):
            out = Fp8Experts(w13.shape[0], w2.shape[2], w13.shape[2], scheme)
        out.to_empty(device=w13.device)
        with torch.no_grad():
            for e in range(w13.shape[0]):  # one expert at a time: little transient memory
                for w, q, s in ((w13[e], out.gate_up_proj[e], out.gate_up_scale[e]),
                                (w2[e], out.down_proj[e], out.down_scale[e])):
                    qw, sw = quantize_rows(w.detach())
                    q.copy_(qw)
                    s.copy_(sw.reshape(-1))
        return out

    def extra_repr(self) -> str:
        e, two_i, h = self.gate_up_proj.shape
        return f"experts={e}, inter={two_i // 2}, hidden={h}, format={self.scheme.name}"


def check_expert_blocks(scheme: Fp8Scheme, inter: int, tp_size: int) -> None:
    """Refuse block scales that this rank's expert width (``inter``) would cut, in one line."""
    if scheme.block is None or inter % scheme.block[0] == 0:
        return
    bn = scheme.block[0]
    full = inter * tp_size
    ok = [n for n in range(1, full // bn + 1) if full % n == 0 and (full // n) % bn == 0]
    what = f"--tensor-parallel-size {tp_size}" if tp_size > 1 else "this expert width"
    raise ConfigError(f"{what} would cut the checkpoint's {bn}x{scheme.block[1]} FP8 "
                      f"blocks of the experts (per rank: expert width {inter}); sizes that "
                      f"keep whole blocks: {', '.join(map(str, ok)) or 'none'}")
