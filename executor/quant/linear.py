"""``Fp8Linear``: a projection whose weight is stored in FP8 with its scales.

It takes the place of the model's ``nn.Linear`` (``install.install``) before the weights
load, reads its weight and scales from the checkpoint (``load``: fused q/k/v and gate/up
shards each with their own scales, and this rank's slice of all of them), and is then
either replaced by an ``nn.Linear`` holding the dequantized weight (devices without FP8)
or given its GEMM (``gemm.prepare``). Its forward is that GEMM: the model code does not
change, since every op path calls ``layer(x)`` for a module that is not a plain Linear.

Scale layouts (float32 multipliers): ``fp8_block`` (ceil(N/128), ceil(K/128)),
``fp8_per_channel`` (N, 1), ``fp8_per_tensor`` one per fused shard (shards,), plus a
static ``input_scale`` (shards,) where the checkpoint has one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from executor.errors import ModelLoadError
from executor.quant.fp8 import FP8, dequantize, quantize_rows
from executor.quant.scheme import Fp8Scheme


class FixedDtypes(nn.Module):
    """A module whose weight format fixes its parameters' dtypes, not the serving dtype: a
    model-wide ``.to(dtype)`` (``materialize``) must not turn FP8 weights or float32 scales
    into bf16. Device moves and ``to_empty`` apply as usual; the parameters named in
    ``serving_dtype`` (a bias) follow the serving dtype."""

    serving_dtype: tuple[str, ...] = ()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
               ) -> FixedDtypes:
        kept = {n: p.dtype for n, p in self._parameters.items()
                if p is not None and n not in self.serving_dtype}
        super()._apply(fn, recurse)
        for n, dtype in kept.items():
            p = self._parameters[n]
            if p is not None and p.dtype != dtype:
                self._parameters[n] = nn.Parameter(p.detach().to(dtype), requires_grad=False)
        return self


class Fp8Linear(FixedDtypes):
    """``y = x @ dequantize(weight).T (+ bias)`` with ``weight`` (N, K) in e4m3.

    ``shards``: the output rows of each checkpoint tensor fused into this one (q, k, v /
    gate, up), this rank's share; ``split``: the dimension tensor parallelism cuts the
    weight along (0 column-parallel, 1 row-parallel, None replicated). ``gemm`` is set by
    ``gemm.prepare`` (``path`` names it for the start-up log).
    """

    serving_dtype = ("bias",)

    def __init__(self, in_features: int, out_features: int, scheme: Fp8Scheme,
                 shards: tuple[int, ...], split: int | None, bias: bool) -> None:
        super().__init__()
        assert sum(shards) == out_features, (shards, out_features)
        self.in_features, self.out_features = in_features, out_features
        self.scheme, self.shards, self.split = scheme, shards, split
        self.offsets = (0, *[sum(shards[: i + 1]) for i in range(len(shards))])
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8),
                                   requires_grad=False)
        self.register_parameter(scheme.scale_name, nn.Parameter(
            torch.empty(self._scale_shape(), dtype=torch.float32), requires_grad=False))
        self.input_scale: nn.Parameter | None = None
        if scheme.static_input:
            self.input_scale = nn.Parameter(torch.empty(len(shards), dtype=torch.float32),
                                            requires_grad=False)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
        self.gemm: Callable[[torch.Tensor], torch.Tensor] | None = None
        #: (x, residual or None, norm weight, eps) -> (out, x + residual or None), or None
        #: where the shape or dtypes do not fuse; (gate_up) -> out, or None. Set with ``gemm``.
        self.norm_gemm: Callable[..., tuple[torch.Tensor, torch.Tensor | None] | None] | None = None
        self.silu_mul_gemm: Callable[[torch.Tensor], torch.Tensor | None] | None = None
        #: As ``norm_gemm`` for a fused gate|up weight, with the gated epilogue: out is
        #: ``silu(gate) * up`` (M, N / 2). Set with ``gemm``.
        self.norm_glu_gemm: Callable[..., tuple[torch.Tensor, torch.Tensor | None] | None] \
            | None = None
        #: (x) -> the path ``gemm`` takes for it ("w8a16", "dot", "scaled_mm"). Set with it.
        self.route_of: Callable[[torch.Tensor], str] | None = None
        self.path = ""

    def _scale_shape(self) -> tuple[int, ...]:
        if self.scheme.kind == "fp8_block":
            assert self.scheme.block is not None
            bn, bk = self.scheme.block
            return (-(-self.out_features // bn), -(-self.in_features // bk))
        if self.scheme.kind == "fp8_per_channel":
            return (self.out_features, 1)
        return (len(self.shards),)

    @property
    def scales(self) -> torch.Tensor:
        """The weight scales, whatever the checkpoint calls them."""
        return getattr(self, self.scheme.scale_name)  # type: ignore[no-any-return]

    # -- loading --------------------------------------------------------------------
    def load(self, reader: Any, hf_name: str, pname: str, shard: int | None, rank: int,
             size: int, where: str) -> None:
        """Copy this rank's part of checkpoint tensor ``hf_name`` (our parameter ``pname``,
        fused shard ``shard``) into place."""
        s = 0 if shard is None else shard
        lo, hi = self.offsets[s], self.offsets[s + 1]
        param: torch.Tensor = getattr(self, pname)
        if pname == "weight":
            target, dim = param[lo:hi], self.split
        elif pname == "bias":
            target, dim = param[lo:hi], (0 if self.split == 0 else None)
        elif pname == "input_scale":
            target, dim = param[s : s + 1], None
        elif self.scheme.kind == "fp8_block":
            assert self.scheme.block is not None
            bn = self.scheme.block[0]
            target, dim = param[lo // bn : -(-hi // bn)], self.split
        elif self.scheme.kind == "fp8_per_channel":
            target, dim = param[lo:hi], (0 if self.split == 0 else None)
        else:
            target, dim = param[s : s + 1], None
        copy_split(reader, hf_name, target, dim, rank, size, where)

    # -- what the device without FP8 serves -------------------------------------------
    def row_scales(self) -> torch.Tensor:
        """Per output row float32 scales (N,) (not for block scales)."""
        scale = self.scales
        if self.scheme.kind == "fp8_per_channel":
            return scale.reshape(-1)
        rows = torch.tensor(self.shards, device=scale.device)
        return scale.repeat_interleave(rows)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight dequantized to ``dtype`` (N, K)."""
        if self.scheme.kind == "fp8_block":
            return dequantize(self.weight, self.scales, self.scheme.block, dtype)
        return dequantize(self.weight, self.row_scales().reshape(-1, 1), None, dtype)

    def to_linear(self, dtype: torch.dtype) -> nn.Linear:
        """An ``nn.Linear`` holding the dequantized weight (and the bias) in ``dtype``."""
        dev = self.weight.device
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                           device=dev, dtype=dtype)
        with torch.no_grad():
            linear.weight.copy_(self.dense_weight(dtype))
            if self.bias is not None:
                assert linear.bias is not None
                linear.bias.copy_(self.bias)
        return linear.requires_grad_(False)

    @staticmethod
    def quantize(linear: nn.Linear, scheme: Fp8Scheme, shards: tuple[int, ...],
                 split: int | None) -> Fp8Linear:
        """``--quantization fp8``: ``linear``'s weight quantized per output row."""
        w = linear.weight
        with torch.device("meta"):
            out = Fp8Linear(w.shape[1], w.shape[0], scheme, shards, split,
                            linear.bias is not None)
        out.to_empty(device=w.device)
        q, scale = quantize_rows(w.detach())
        with torch.no_grad():
            out.weight.copy_(q)
            out.scales.copy_(scale)
            if out.bias is not None:
                assert linear.bias is not None
                out.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return out

    def norm_linear(self, x: torch.Tensor, residual: torch.Tensor | None,
                    norm_weight: torch.Tensor, eps: float
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(self(rms_norm(x [+ residual])), x + residual)`` in one launch (the skinny
        kernels' hook, ``executor.kernels.skinny.linear``); None where it does not fuse."""
        got = self.norm_gemm(x, residual, norm_weight, eps) if self.norm_gemm else None
        if got is None:
            return None
        out, res = got
        return (out if self.bias is None else out + self.bias), (x if res is None else res)

    def norm_glu_linear(self, x: torch.Tensor, residual: torch.Tensor | None,
                        norm_weight: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(silu_and_mul(self(rms_norm(x [+ residual]))), x + residual)`` in one launch,
        for a gate|up projection (weight rows [gate; up], per tensor-parallel shard);
        None where it does not fuse (a bias: it would have to come before the SiLU)."""
        if self.norm_glu_gemm is None or self.bias is not None:
            return None
        got = self.norm_glu_gemm(x, residual, norm_weight, eps)
        if got is None:
            return None
        out, res = got
        return out, (x if res is None else res)

    def silu_mul_linear(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """``self(silu_and_mul(gate_up))`` in one launch; None where it does not fuse."""
        out = self.silu_mul_gemm(gate_up) if self.silu_mul_gemm else None
        return out if out is None or self.bias is None else out + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemm is None:
            raise RuntimeError("Fp8Linear has no GEMM: the loader's finalize step did not run")
        y = self.gemm(x)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"format={self.scheme.name}, path={self.path or '-'}")


def copy_split(reader: Any, hf_name: str, target: torch.Tensor, dim: int | None, rank: int,
               size: int, where: str) -> None:
    """Copy this rank's slice (along ``dim``, of ``size`` equal ones) of ``hf_name`` into
    ``target``. A checkpoint shape that differs from the expected one only by dimensions
    of size 1 (a scale stored as (N,) or (N, 1), a scalar as () or (1,)) is accepted."""
    piece = reader.get_slice(hf_name)
    full = tuple(piece.get_shape())
    local = tuple(target.shape)
    cut = dim is not None and size > 1
    expected = tuple(d * size if cut and i == dim else d for i, d in enumerate(local))
    squeeze = [d for d in full if d != 1], [d for d in expected if d != 1]
    if squeeze[0] != squeeze[1] or math.prod(full) != math.prod(expected):
        split = f" (split {size} ways into {local})" if cut else ""
        raise ModelLoadError(f"shape mismatch for {hf_name!r} in {where}: expected "
                             f"{expected}{split}, got {full}")
    if not full:
        values = reader.get_tensor(hf_name)
    elif not cut:
        values = piece[:]
    else:
        assert dim is not None
        lo, hi = rank * local[dim], (rank + 1) * local[dim]
        values = piece[lo:hi] if dim == 0 else piece[:, lo:hi]
    target.copy_(values.reshape(local).to(target.dtype))
