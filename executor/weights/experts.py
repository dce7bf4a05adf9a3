"""Checkpoint names of mixture-of-experts weights, and how they fill the stacked experts.

Published checkpoints (and transformers' ``save_pretrained``) store one tensor per expert
and projection: Qwen3-MoE ``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``, Mixtral
``block_sparse_moe.experts.{e}.w1/w3/w2.weight`` (gate, up, down) and
``block_sparse_moe.gate.weight`` (the router, our ``mlp.gate.weight``). transformers'
in-memory layout, stacked ``mlp.experts.gate_up_proj`` ``(E, 2I, H)`` and
``mlp.experts.down_proj`` ``(E, H, I)``, is accepted too. Each fills its slice of our
per-layer stacks; under tensor parallelism a rank reads its rows of gate and up and its
columns of down of every expert (``I`` split like a dense MLP's).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from executor.errors import ModelLoadError

_PER_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\."
                         r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_PER_EXPERT_SCALE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\."
                               r"(gate_proj|up_proj|down_proj|w1|w3|w2)\."
                               r"(weight_scale|weight_scale_inv|input_scale)$")
_STACKED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
# checkpoint projection -> (our stacked parameter, part: 0 gate, 1 up, None down)
_PARTS: dict[str, tuple[str, int | None]] = {
    "gate_proj": ("gate_up_proj", 0), "w1": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1), "w3": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None), "w2": ("down_proj", None),
}


def canonical(hf_name: str) -> str:
    """Mixtral's ``block_sparse_moe`` module is our (and transformers') ``mlp``."""
    return hf_name.replace(".block_sparse_moe.", ".mlp.")


@dataclass(frozen=True)
class ExpertSource:
    """Where a checkpoint tensor goes: ``param`` (our name), ``expert`` (None: all of them,
    a stacked tensor), ``part`` (0 gate, 1 up, None for down or a whole gate_up stack)."""

    param: str
    expert: int | None
    part: int | None

    def keys(self, num_experts: int) -> set[tuple[str, int | None]]:
        """The (parameter, shard) keys of ``expected_keys`` this tensor fills."""
        experts = range(num_experts) if self.expert is None else (self.expert,)
        if self.param.endswith(("down_proj", "down_scale")):
            return {(self.param, e) for e in experts}
        parts = (0, 1) if self.part is None else (self.part,)
        return {(self.param, 2 * e + p) for e in experts for p in parts}


def match(hf_name: str) -> ExpertSource | None:
    """The expert weight ``hf_name`` (already ``canonical``) names, else None."""
    m = _PER_EXPERT.match(hf_name)
    if m is not None:
        param, part = _PARTS[m.group(3)]
        return ExpertSource(f"layers.{m.group(1)}.mlp.experts.{param}", int(m.group(2)), part)
    m = _STACKED.match(hf_name)
    if m is not None:
        return ExpertSource(f"layers.{m.group(1)}.mlp.experts.{m.group(2)}", None, None)
    return None


def match_scale(hf_name: str) -> tuple[ExpertSource, str] | None:
    """An FP8 expert's scale tensor (already ``canonical``): where it goes (our stacked
    scale parameter ``gate_up_scale`` or ``down_scale``) and the checkpoint's kind of scale
    (``weight_scale``, ``weight_scale_inv`` or ``input_scale``); else None."""
    m = _PER_EXPERT_SCALE.match(hf_name)
    if m is None:
        return None
    param, part = _PARTS[m.group(3)]
    scale = "gate_up_scale" if param == "gate_up_proj" else "down_scale"
    return ExpertSource(f"layers.{m.group(1)}.mlp.experts.{scale}", int(m.group(2)),
                        part), m.group(4)


def expected_keys(name: str, param: torch.Tensor) -> set[tuple[str, int | None]] | None:
    """Every (parameter, shard) a stacked experts parameter (weights, or FP8 scales) needs,
    else None."""
    if name.endswith((".experts.gate_up_proj", ".experts.gate_up_scale")):
        return {(name, s) for s in range(2 * param.shape[0])}
    if name.endswith((".experts.down_proj", ".experts.down_scale")):
        return {(name, e) for e in range(param.shape[0])}
    return None


def copy_expert(reader: Any, hf_name: str, src: ExpertSource, target: torch.Tensor,
                rank: int, size: int, where: str) -> None:
    """Copy this rank's slice of ``hf_name`` into the stacked parameter ``target``
    (``(E, 2I, H)`` or ``(E, H, I)``, ``I`` this rank's width)."""
    piece = reader.get_slice(hf_name)
    full = tuple(piece.get_shape())
    experts, rows, cols = target.shape
    down = src.param.endswith("down_proj")
    width = cols if down else rows // 2  # this rank's I
    lo, hi = rank * width, (rank + 1) * width
    if src.expert is not None:  # one expert's (I, H) gate/up or (H, I) down
        want: tuple[int, ...] = (rows, width * size) if down else (width * size, cols)
        if full != want:
            raise ModelLoadError(f"shape mismatch for {hf_name!r} in {where}: expected {want}, "
                                 f"got {full}")
        if src.expert >= experts:
            raise ModelLoadError(f"{hf_name!r} in {where} names expert {src.expert}; the "
                                 f"config has {experts} experts")
        dst = target[src.expert]
        if down:
            dst.copy_(piece[:, lo:hi].to(target.dtype))
        else:
            assert src.part is not None
            dst[src.part * width : (src.part + 1) * width].copy_(piece[lo:hi].to(target.dtype))
        return
    want = (experts, rows, width * size) if down else (experts, 2 * width * size, cols)
    if full != want:
        raise ModelLoadError(f"shape mismatch for {hf_name!r} in {where}: expected {want}, "
                             f"got {full}")
    if down:
        target.copy_(piece[:, :, lo:hi].to(target.dtype))
        return
    full_width = width * size
    target[:, :width].copy_(piece[:, lo:hi].to(target.dtype))
    target[:, width:].copy_(piece[:, full_width + lo : full_width + hi].to(target.dtype))


def moe_layer_recipe(cfg: Any, layer: int) -> dict[str, tuple[tuple[int, ...], float]] | None:
    """HF name -> (shape, std) of a sparse layer's router and experts in the published
    per-expert layout, for random checkpoints; None for a dense layer or a dense model."""
    from executor.model.spec import MOE_ARCHITECTURES, spec_from_hf_config

    archs = list(getattr(cfg, "architectures", None) or [])
    if not archs or archs[0] not in MOE_ARCHITECTURES:
        return None
    moe = spec_from_hf_config(cfg).moe
    assert moe is not None
    if not moe.sparse(layer):
        return None
    h, i = int(cfg.hidden_size), moe.intermediate_size
    mixtral = archs[0] == "MixtralForCausalLM"
    p = f"model.layers.{layer}.{'block_sparse_moe' if mixtral else 'mlp'}."
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    # a router spread wide enough that no two experts tie in a greedy comparison
    out: dict[str, tuple[tuple[int, ...], float]] = {
        p + "gate.weight": ((moe.num_experts, h), 2 / math.sqrt(h))}
    for e in range(moe.num_experts):
        out[p + f"experts.{e}.{names[0]}.weight"] = ((i, h), 1 / math.sqrt(h))
        out[p + f"experts.{e}.{names[1]}.weight"] = ((i, h), 1 / math.sqrt(h))
        out[p + f"experts.{e}.{names[2]}.weight"] = ((h, i), 1 / math.sqrt(i))
    return out


# -- in-place updates (``weights/update.py``) ---------------------------------------------
def is_stacked(name: str) -> bool:
    """Whether our parameter ``name`` is a layer's stacked experts."""
    return name.endswith((".experts.gate_up_proj", ".experts.down_proj"))


def full_shape(src: ExpertSource, param: torch.Tensor, tp_size: int) -> tuple[int, ...]:
    """The unsharded shape of the checkpoint tensor ``src`` names, for a stacked parameter
    ``param`` holding this rank's ``(E, 2I, H)`` or ``(E, H, I)``."""
    experts, rows, cols = param.shape
    if src.param.endswith("down_proj"):
        one: tuple[int, ...] = (rows, cols * tp_size)
        whole = (experts, rows, cols * tp_size)
    else:
        one, whole = (rows // 2 * tp_size, cols), (experts, rows * tp_size, cols)
    return one if src.expert is not None else whole


def hf_name(param: str, shard: int) -> str:
    """The published per-expert name of our (stacked parameter, shard), for messages."""
    layer = param.split(".")[1]
    if param.endswith("down_proj"):
        return f"model.layers.{layer}.mlp.experts.{shard}.down_proj.weight"
    part = "gate_proj" if shard % 2 == 0 else "up_proj"
    return f"model.layers.{layer}.mlp.experts.{shard // 2}.{part}.weight"
