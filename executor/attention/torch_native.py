"""Reference attention in plain PyTorch: one SDPA call per sequence, or one for a whole
decode batch (every sequence adds one token: keys padded to the longest and masked), so a
CPU decode step costs a few launches per layer whatever its batch.

Correct on CPU and CUDA for any batch; it reads host-side lengths, so it is never captured.
It is the reference the Triton and FlashInfer kernels are checked against, sliding windows
and logit soft-capping (``AttentionShape``) included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from executor.api import Phase
from executor.attention.base import AttentionBackend, AttentionMetadata
from executor.forward_batch import ForwardBatch


@dataclass(frozen=True)
class TorchNativeMetadata(AttentionMetadata):
    out_cache_loc: torch.Tensor  # (T,)
    # Per sequence: (slot, prefix_len, new_len, start in packed tokens), from the host.
    seqs: tuple[tuple[int, int, int, int], ...]
    kv_locations: tuple[torch.Tensor, ...]  # per sequence: (seq_len,) locations, on device
    # A decode batch (one new token per sequence; no ``kv_locations``): (B, L) locations
    # padded to the longest sequence, and (B, L) key positions (-1 past a sequence's end).
    decode_locations: torch.Tensor | None = None
    decode_positions: torch.Tensor | None = None


class TorchNativeBackend(AttentionBackend):
    name: ClassVar[str] = "torch_native"
    capturable: ClassVar[frozenset[Phase]] = frozenset()

    def build_metadata(self, batch: ForwardBatch) -> TorchNativeMetadata:
        seqs = tuple(zip(batch.slots_host, batch.prefix_lens_host,
                         batch.extend_lens_host, batch.extend_start_host, strict=True))
        table = self.table.device_table
        if all(n == 1 for n in batch.extend_lens_host):
            longest = max(batch.seq_lens_host)
            # Past a sequence's end its table row holds stale or dummy locations: finite
            # values, masked out below.
            locs2 = table[batch.slots, :longest].to(torch.int64)  # (B, L)
            key_pos = torch.arange(longest, device=locs2.device).expand_as(locs2)
            key_pos = key_pos.masked_fill(key_pos >= batch.seq_lens[:, None], -1)
            return TorchNativeMetadata(batch.out_cache_loc, seqs, (), locs2, key_pos)
        locs = tuple(table[slot, : prefix + n].to(torch.int64) for slot, prefix, n, _ in seqs)
        return TorchNativeMetadata(batch.out_cache_loc, seqs, locs)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                meta: AttentionMetadata) -> torch.Tensor:
        assert isinstance(meta, TorchNativeMetadata)
        self.pool.store(layer_id, meta.out_cache_loc, k, v)
        k_pool, v_pool = self.pool.k[layer_id], self.pool.v[layer_id]
        window, cap = self.shape.window(layer_id), self.shape.softcap
        if meta.decode_locations is not None and meta.decode_positions is not None:
            return self._decode(q, k_pool, v_pool, meta.decode_locations,
                                meta.decode_positions, window, cap)
        out = torch.empty_like(q)
        group = self.shape.num_heads // self.shape.num_kv_heads
        for (_, prefix, n, start), locs in zip(meta.seqs, meta.kv_locations, strict=True):
            # (heads, n, d) queries against (heads, prefix + n, d) keys.
            qi = q[start : start + n].transpose(0, 1)
            ki = k_pool[locs].to(q.dtype).transpose(0, 1).repeat_interleave(group, dim=0)
            vi = v_pool[locs].to(q.dtype).transpose(0, 1).repeat_interleave(group, dim=0)
            # Query j (absolute position prefix + j) sees keys 0 .. prefix + j, and with a
            # window only those after prefix + j - window.
            mask = torch.ones(n, prefix + n, dtype=torch.bool, device=q.device).tril(prefix)
            if window:
                mask = mask.triu(prefix - window + 1)
            if cap:
                oi = _softcapped_attention(qi, ki, vi, mask, self.shape.scale, cap)
            else:
                oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask,
                                                    scale=self.shape.scale)
            out[start : start + n] = oi.transpose(0, 1)
        return out

    def _decode(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                locs: torch.Tensor, key_pos: torch.Tensor, window: int,
                cap: float) -> torch.Tensor:
        """One new token per sequence: ``q`` (B, heads, d) against each sequence's keys,
        ``locs``/``key_pos`` (B, L). Query heads ``g * group ..`` share KV head ``g``."""
        b, heads, d = q.shape
        kv_heads = self.shape.num_kv_heads
        qg = q.reshape(b, kv_heads, heads // kv_heads, d)  # (B, kv_heads, group, d)
        flat, keys = locs.reshape(-1), locs.shape[1]
        # (index_select on the flat locations: a fraction of advanced indexing's time)
        ki = k_pool.index_select(0, flat).view(b, keys, kv_heads, d)
        vi = v_pool.index_select(0, flat).view(b, keys, kv_heads, d)
        ki = ki.to(q.dtype).transpose(1, 2)  # (B, kv_heads, L, d)
        vi = vi.to(q.dtype).transpose(1, 2)
        mask = key_pos >= 0  # (B, L); the query sits at the last valid position
        if window:
            last = key_pos.amax(dim=1, keepdim=True)
            mask = mask & (key_pos > last - window)
        mask = mask[:, None, None, :]  # (B, 1, 1, L)
        if cap:
            out = _softcapped_attention(qg, ki, vi, mask, self.shape.scale, cap)
        else:
            out = F.scaled_dot_product_attention(qg, ki, vi, attn_mask=mask,
                                                 scale=self.shape.scale)
        return out.reshape(b, heads, d)


def _softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          mask: torch.Tensor, scale: float, cap: float) -> torch.Tensor:
    """Attention with scores ``cap * tanh(scale * q.k / cap)`` (SDPA has no soft-cap), op
    for op as Hugging Face's eager Gemma 2 attention: scores in the input dtype, the
    softmax in float32. ``q`` (heads, n, d), ``k``/``v`` (heads, keys, d), ``mask`` (n, keys)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)
