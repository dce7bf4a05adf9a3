"""Vocabulary-parallel embedding and LM head: each rank holds ``VocabShard`` rows.

The embedding looks up the ids that fall in this rank's rows (zeros for the others) and
sums over the ranks; the LM head computes this rank's logits and gathers every rank's, so
every rank ends with the full ``(S, vocab)`` logits (rank 0 samples). Gathering to every
rank rather than to rank 0 alone keeps one collective that NCCL captures in a graph and
costs the same on the links for these sizes; sampling vocab-parallel (a gathered max per
row) is an alternative not tried.
"""

from __future__ import annotations

import torch
from torch import nn

from executor.distributed.group import TensorParallel
from executor.model.layers import TRITON_OPS, KernelChoice, select_ops
from executor.weights.sharding import VocabShard


class VocabParallelEmbedding(nn.Module):
    """``kernels``: the model's ``KernelChoice``; where ``select_ops`` takes the fused
    kernels for this weight, a rank of a larger group looks its rows up in one of them
    (``executor.kernels.embedding``)."""

    def __init__(self, vocab: int, hidden: int, tp: TensorParallel,
                 kernels: KernelChoice = "auto") -> None:
        super().__init__()
        self.tp, self.shard = tp, VocabShard.of(vocab, tp.rank, tp.size)
        self.kernels = kernels
        self.weight = nn.Parameter(torch.empty(self.shard.rows, hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, hidden)
        if self.tp.size == 1:  # all rows here; the reduce still runs (one rank, real group)
            return self.tp.all_reduce(nn.functional.embedding(ids, self.weight))
        if select_ops(self.kernels, self.weight) is TRITON_OPS:
            from executor import kernels  # (imports Triton: only where it runs)

            return self.tp.all_reduce(kernels.shard_embedding(ids, self.weight,
                                                              self.shard.start))
        local = ids - self.shard.start
        mine = (local >= 0) & (ids < self.shard.end)
        out = nn.functional.embedding(local.clamp(0, self.shard.rows - 1), self.weight)
        return self.tp.all_reduce(out * mine.unsqueeze(-1).to(out.dtype))


class ParallelLMHead(nn.Module):
    def __init__(self, vocab: int, hidden: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp, self.vocab = tp, vocab
        self.shard = VocabShard.of(vocab, tp.rank, tp.size)
        self.weight = nn.Parameter(torch.empty(self.shard.rows, hidden))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (S, hidden) -> (S, vocab)
        s, n = hidden.shape[0], self.tp.size
        if s == 0:  # a step that samples nothing: every rank has no rows, so all skip
            return hidden.new_empty(0, self.vocab)
        local = nn.functional.linear(hidden, self.weight)  # (S, rows)
        gathered = self.tp.all_gather(local)  # (N * S, rows), rank-major
        full = gathered.view(n, s, self.shard.rows).transpose(0, 1).reshape(s, n * self.shard.rows)
        return full[:, : self.vocab]
