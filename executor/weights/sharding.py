"""Which slice of each weight a rank holds, and the model shape one rank computes.

Megatron-style splits of a Llama decoder over ``N`` ranks: qkv_proj (q, k, v each, and
its bias) and gate_up_proj (gate, up each) by rows (column-parallel: attention on local
heads, SiLU-and-mul on local rows); o_proj and down_proj by columns (row-parallel, an
all-reduce after each); embed_tokens and lm_head by vocabulary rows (an all-reduce / an
all-gather after them); norms and q_norm / k_norm replicated.

Mixture-of-experts blocks: every expert is split like the dense MLP (its gate and up rows,
its down columns: ``weights/experts.py``); the router is replicated.

A checkpoint that stores q/k/v or gate/up fused (Phi-3's ``qkv_proj``, ``gate_up_proj``)
is cut per part (``copy_fused_shard``): each rank reads its rows of q, of k and of v.

Query and KV heads must both divide by ``N`` (so must the MLP and expert widths): a model that does
not is refused with one line listing the sizes that work. KV heads are never replicated
(``N`` above the KV head count is refused, not served with copies). The vocabulary is cut
in ``ceil(V / N)``-row pieces; the last rank's piece is padded with zero rows, whose
logits are dropped after the gather.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import torch

from executor.errors import ConfigError, ModelLoadError
from executor.model.spec import ModelSpec

# Internal (fused) parameter name part -> the dimension its rank slices are cut along.
_SPLIT_DIM: dict[str, int] = {
    ".qkv_proj.": 0, ".gate_up_proj.": 0, ".o_proj.": 1, ".down_proj.": 1,
}
_VOCAB_PARAMS = ("embed_tokens.weight", "lm_head.weight")


def valid_sizes(spec: ModelSpec) -> list[int]:
    """Tensor-parallel sizes that split this model evenly."""
    g = math.gcd(spec.num_heads, spec.num_kv_heads, spec.intermediate_size,
                 spec.moe.intermediate_size if spec.moe is not None else 0)
    return [n for n in range(1, g + 1) if g % n == 0]


def check_divisible(spec: ModelSpec, size: int) -> None:
    """Refuse a size that does not divide the heads (one line, saying which sizes work)."""
    if size < 1:
        raise ConfigError(f"tensor parallel size must be >= 1, got {size}")
    if size in valid_sizes(spec):
        return
    experts, ep = "", ""
    if spec.moe is not None:
        experts = f", expert width {spec.moe.intermediate_size}"
        ep = "; expert parallelism is not supported"
    raise ConfigError(
        f"--tensor-parallel-size {size} does not divide the model's {spec.num_heads} query "
        f"heads, {spec.num_kv_heads} KV heads{experts} and MLP width {spec.intermediate_size} "
        f"(KV heads are not replicated{ep}); sizes that work: "
        f"{', '.join(map(str, valid_sizes(spec)))}")


def local_spec(spec: ModelSpec, size: int) -> ModelSpec:
    """The shape one of ``size`` ranks computes: its heads and MLP rows (vocabulary and
    hidden size stay whole: the gathered logits and the residual stream are full)."""
    check_divisible(spec, size)
    if size == 1:
        return spec
    moe = spec.moe and dataclasses.replace(
        spec.moe, intermediate_size=spec.moe.intermediate_size // size)
    return dataclasses.replace(spec, num_heads=spec.num_heads // size,
                               num_kv_heads=spec.num_kv_heads // size,
                               intermediate_size=spec.intermediate_size // size, moe=moe)


@dataclasses.dataclass(frozen=True)
class VocabShard:
    """Rows ``start:end`` of the vocabulary, held in ``rows`` (>= end - start) rows."""

    start: int
    end: int
    rows: int

    @staticmethod
    def of(vocab: int, rank: int, size: int) -> VocabShard:
        per = -(-vocab // size)  # ceil
        start = min(rank * per, vocab)
        return VocabShard(start, min(start + per, vocab), per)


def split_dim(name: str) -> int | None:
    """The dimension ``name``'s rank slices are cut along; None for replicated ones."""
    if name in _VOCAB_PARAMS:
        return 0
    for part, dim in _SPLIT_DIM.items():
        if part in name:
            return dim
    return None


def copy_shard(reader: Any, hf_name: str, name: str, target: torch.Tensor, rank: int,
               size: int, where: str) -> None:
    """Copy this rank's slice of checkpoint tensor ``hf_name`` into ``target``.

    ``reader`` is an open ``safetensors.safe_open``; only the slice is read
    (``get_slice``), so no rank materializes a whole split weight. ``name`` is our
    parameter's name (its fused shard already cut out of ``target``); ``where`` names the
    file in errors. Vocabulary rows past the checkpoint's are zeroed.
    """
    piece = reader.get_slice(hf_name)
    full = tuple(piece.get_shape())
    local = tuple(target.shape)
    dim = split_dim(name)
    if dim is None or size == 1:
        if full != local:
            raise ModelLoadError(f"shape mismatch for {hf_name!r} in {where}: expected "
                                 f"{local}, got {full}")
        target.copy_(piece[:].to(target.dtype))
        return
    if name in _VOCAB_PARAMS:
        shard = VocabShard.of(full[0], rank, size)
        if full[1:] != local[1:] or local[0] != shard.rows:
            raise ModelLoadError(f"shape mismatch for {hf_name!r} in {where}: expected "
                                 f"({local[0] * size}, ...) split {size} ways into {local}, "
                                 f"got {full}")
        n = shard.end - shard.start
        target[:n].copy_(piece[shard.start : shard.end].to(target.dtype))
        target[n:].zero_()
        return
    expected = tuple(d * size if i == dim else d for i, d in enumerate(local))
    if full != expected:
        raise ModelLoadError(f"shape mismatch for {hf_name!r} in {where}: expected {expected} "
                             f"(split {size} ways into {local}), got {full}")
    lo, hi = rank * local[dim], (rank + 1) * local[dim]
    part = piece[lo:hi] if dim == 0 else piece[:, lo:hi]
    target.copy_(part.to(target.dtype))


def copy_fused_shard(reader: Any, hf_name: str, target: torch.Tensor, local_rows: list[int],
                     rank: int, size: int, where: str) -> None:
    """Copy this rank's rows of a checkpoint tensor that stores several column-parallel
    parts stacked by rows (q, k, v or gate, up) into ``target``, whose parts start at
    ``local_rows`` (one rank's sizes; the checkpoint's parts are ``size`` times larger)."""
    piece = reader.get_slice(hf_name)
    full = tuple(piece.get_shape())
    local = tuple(target.shape)
    expected = (local[0] * size, *local[1:])
    if full != expected:
        split = f" (split {size} ways into {local})" if size > 1 else ""
        raise ModelLoadError(f"shape mismatch for {hf_name!r} in {where}: expected "
                             f"{expected}{split}, got {full}")
    for lo, hi in itertools.pairwise(local_rows):
        n = hi - lo
        first = lo * size + rank * n  # the part starts at lo * size in the checkpoint
        target[lo:hi].copy_(piece[first : first + n].to(target.dtype))
