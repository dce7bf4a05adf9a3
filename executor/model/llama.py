"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over our KV pools.

Tokens are packed: every tensor is ``(T, ...)`` for the ``T`` new tokens of a batch, with
no padding and no batch dimension. Attention is delegated to an ``AttentionBackend``; the
model never sees how sequences are laid out, only the metadata object it passes along.
"""

from __future__ import annotations

import torch
from torch import nn

from executor.attention.base import AttentionBackend, AttentionMetadata
from executor.model.layers import GatedMLP, RMSNorm, RotaryEmbedding
from executor.model.spec import ModelSpec


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads = spec.num_heads, spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size, self.kv_size = spec.q_size, spec.kv_size
        # q, k and v projections fused into one matmul: (hidden) -> (q + 2 * kv)
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=spec.features.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, spec.rms_norm_eps) if spec.features.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, spec.rms_norm_eps) if spec.features.qk_norm else None
        self.rotary = rotary

    def forward(self, positions: torch.Tensor, x: torch.Tensor, backend: AttentionBackend,
                meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = backend.forward(q, k, v, self.layer_id, meta)  # (T, heads, head_dim)
        return self.o_proj(out.reshape(t, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, layer_id, rotary)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = GatedMLP(spec.hidden_size, spec.intermediate_size)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, backend: AttentionBackend,
                meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), backend, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    """Decoder plus LM head. ``forward`` returns final hidden states ``(T, hidden)``;
    ``compute_logits`` turns selected rows into float32 logits ``(S, vocab)``."""

    def __init__(self, spec: ModelSpec, max_positions: int) -> None:
        super().__init__()
        self.spec = spec
        self.rotary = RotaryEmbedding(spec.rope, spec.head_dim, max_positions)
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(spec, i, self.rotary) for i in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                backend: AttentionBackend, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x, backend, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
