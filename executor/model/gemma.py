"""The Gemma 2 and Gemma 3 (text) decoders over our KV pools, as Hugging Face defines them.

What they add to the Llama decoder (``spec.features.gemma_norms``): RMSNorms whose scale
is ``1 + weight``, computed in float32 and rounded once; a norm after attention and
around the MLP (pre/post feed-forward); embeddings times ``sqrt(hidden)`` rounded to the
model dtype; a GELU(tanh)-gated MLP. From the config: scores scaled by
``query_pre_attn_scalar ** -0.5``, attention and final logit soft-capping, per-layer
sliding windows (``AttentionShape``), a per-head q/k norm (Gemma 3) and a RoPE base of
their own for sliding layers (Gemma 3's local base).

The residual stream is threaded across layers so each add goes with the norm after it
(``GemmaNormOps.add_norm``: one kernel on CUDA): a layer takes its input already normed.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from executor.attention.base import AttentionBackend, AttentionMetadata
from executor.distributed.group import TensorParallel
from executor.model.base import register_model
from executor.model.gemma_ops import GemmaNormOps, prepare_gemma_kernels, select_gemma_ops
from executor.model.layers import (
    KernelChoice,
    LayerOps,
    RotaryEmbedding,
    prepare_kernels,
    select_ops,
)
from executor.model.spec import ARCHITECTURES, ModelSpec
from executor.model.vocab_parallel import ParallelLMHead, VocabParallelEmbedding


class GemmaRMSNorm(nn.Module):
    """Holds the weight (zero-centred: the scale is ``1 + weight``); the arithmetic is
    ``GemmaNormOps``'."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps


class GemmaAttention(nn.Module):
    """This rank's heads: fused QKV, an optional per-head q/k norm, the layer's RoPE and
    window (the backend reads the window and soft-cap from its ``AttentionShape``)."""

    def __init__(self, spec: ModelSpec, layer_id: int, rotary: RotaryEmbedding,
                 tp: TensorParallel) -> None:
        super().__init__()
        self.layer_id, self.tp, self.rotary = layer_id, tp, rotary
        self.num_heads, self.num_kv_heads = spec.num_heads, spec.num_kv_heads
        self.head_dim, self.q_size, self.kv_size = spec.head_dim, spec.q_size, spec.kv_size
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=False)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=False)
        qk_norm = spec.features.qk_norm
        self.q_norm = GemmaRMSNorm(self.head_dim, spec.rms_norm_eps) if qk_norm else None
        self.k_norm = GemmaRMSNorm(self.head_dim, spec.rms_norm_eps) if qk_norm else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, backend: AttentionBackend,
                meta: AttentionMetadata, ops: LayerOps, norms: GemmaNormOps) -> torch.Tensor:
        """``x`` ``(T, hidden)`` (normed) -> ``(T, hidden)``, all-reduced over the ranks."""
        t = x.shape[0]
        qkv = ops.linear(self.qkv_proj, x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # (never fused: start-up)
            q, k = norms.norm_rope(positions, q, k, self.rotary.cos, self.rotary.sin,
                                   self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        elif not backend.fuses_rope(meta):  # else its decode kernel rotates q and k
            q, k = self.rotary(positions, q, k, ops)
        out = backend.forward(q, k, v, self.layer_id, meta).reshape(t, self.q_size)
        return self.tp.linear_all_reduce(self.o_proj, out, lambda: ops.linear(self.o_proj, out),
                                         send=ops.gemm_sends)


class GemmaMLP(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)
        self.activation = spec.activation

    def forward(self, x: torch.Tensor, ops: LayerOps, norms: GemmaNormOps) -> torch.Tensor:
        gate_up = ops.linear(self.gate_up_proj, x)  # (T, 2 * I)
        if self.activation == "silu":
            return self.tp.linear_all_reduce(
                self.down_proj, gate_up,
                lambda: ops.silu_and_mul_linear(gate_up, self.down_proj), silu_mul=True,
                send=ops.gemm_sends)
        act = norms.gelu_tanh_and_mul(gate_up)  # (T, I)
        return self.tp.linear_all_reduce(self.down_proj, act,
                                         lambda: ops.linear(self.down_proj, act),
                                         send=ops.gemm_sends)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_id: int, rotary: RotaryEmbedding,
                 tp: TensorParallel) -> None:
        super().__init__()
        h, eps = spec.hidden_size, spec.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = GemmaAttention(spec, layer_id, rotary, tp)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = GemmaMLP(spec, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor,
                next_norm: GemmaRMSNorm, backend: AttentionBackend, meta: AttentionMetadata,
                ops: LayerOps, norms: GemmaNormOps) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: ``input_layernorm(residual)``; returns ``(next_norm(residual'),
        residual')`` where ``residual'`` is this layer's output stream (HF: ``residual +
        post_feedforward_layernorm(mlp(...))``)."""
        attn = self.self_attn(positions, x, backend, meta, ops, norms)
        post, pre = self.post_attention_layernorm, self.pre_feedforward_layernorm
        x, residual = norms.add_norm(attn, residual, post.weight, pre.weight, post.eps)
        mlp = self.mlp(x, ops, norms)
        post_ff = self.post_feedforward_layernorm
        return norms.add_norm(mlp, residual, post_ff.weight, next_norm.weight, post_ff.eps)


@register_model(*(arch for arch, f in ARCHITECTURES.items() if f.gemma_norms))
class GemmaCausalLM(nn.Module):
    """Decoder plus LM head, the ``CausalModel`` contract of ``executor.model.base``
    (``forward`` returns the final normed hidden states ``(T, hidden)``;
    ``compute_logits`` the soft-capped logits where the config caps them)."""

    def __init__(self, spec: ModelSpec, max_positions: int, kernels: KernelChoice = "auto",
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        tp = tp or TensorParallel.single()
        prepare_kernels(kernels)
        prepare_gemma_kernels(kernels)
        self.spec = spec
        self.kernels: KernelChoice = kernels
        # Full-attention layers' RoPE; sliding layers share ``rotary_local`` where the
        # config gives them their own base. Only a single table may be fused into the
        # decode kernel (``rotary`` is what start-up offers it).
        global_rotary = RotaryEmbedding(spec.rope, spec.head_dim, max_positions)
        self.rotary_local = RotaryEmbedding(spec.rope_local, spec.head_dim, max_positions) \
            if spec.rope_local is not None else None
        if self.rotary_local is None:
            self.rotary = global_rotary
        else:
            self.rotary_global = global_rotary
        self.embed_tokens: nn.Embedding | VocabParallelEmbedding
        self.lm_head: nn.Linear | ParallelLMHead
        if tp.distributed:
            self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, tp,
                                                       kernels)
            self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, tp)
        else:
            self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
            self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(spec, i, self._layer_rotary(i, global_rotary), tp)
            for i in range(spec.num_layers))
        self.norm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.embed_scale: torch.Tensor
        self.register_buffer("embed_scale", torch.empty(()), persistent=False)

    def _layer_rotary(self, layer_id: int, global_rotary: RotaryEmbedding) -> RotaryEmbedding:
        if self.rotary_local is not None and self.spec.layer_windows[layer_id]:
            return self.rotary_local
        return global_rotary

    def _rotaries(self) -> list[RotaryEmbedding]:
        return [m for m in self.modules() if isinstance(m, RotaryEmbedding)]

    def materialize(self, dtype: torch.dtype, device: torch.device) -> None:
        """Real storage for the meta-device parameters, the RoPE tables and the embedding
        scale: ``sqrt(hidden)`` rounded to the model dtype, as Hugging Face multiplies."""
        self.to(dtype).to_empty(device=device)
        if self.spec.tie_word_embeddings:  # to_empty unties: tie again
            self.lm_head.weight = self.embed_tokens.weight
        for rotary in self._rotaries():
            rotary.init_tables(device)
        self.embed_scale = torch.tensor(math.sqrt(self.spec.hidden_size), dtype=torch.float32,
                                        device=device).to(dtype)

    @property
    def hidden_dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                backend: AttentionBackend, meta: AttentionMetadata) -> torch.Tensor:
        residual = self.embed_tokens(input_ids) * self.embed_scale  # (T, hidden)
        ops = select_ops(self.kernels, residual)
        norms = select_gemma_ops(ops)
        if not self.layers:
            return norms.norm(residual, self.norm.weight, self.norm.eps)
        layers: list[GemmaDecoderLayer] = list(self.layers)  # type: ignore[arg-type]
        first = layers[0].input_layernorm
        x = norms.norm(residual, first.weight, first.eps)
        for layer, nxt in zip(layers, [*(la.input_layernorm for la in layers[1:]), self.norm],
                              strict=True):
            x, residual = layer(positions, x, residual, nxt, backend, meta, ops, norms)
        return x

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None
                       ) -> torch.Tensor:
        """Logits ``(S, vocab)`` in the activation dtype, soft-capped as Hugging Face
        does (``cap * tanh(logits / cap)``) where the config sets a final cap; with
        ``out``, written into its rows ``:S`` and returned as that view."""
        cap = self.spec.final_softcap
        if not cap and isinstance(self.lm_head, nn.Linear):
            # The GEMM writes the buffer itself (no copy kernel after it), as Llama's.
            dst = None if out is None else out[: hidden.shape[0]]
            return select_ops(self.kernels, hidden).logits(self.lm_head, hidden, dst)
        logits = self.lm_head(hidden)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        if out is None:
            return logits
        dst = out[: hidden.shape[0]]
        dst.copy_(logits)
        return dst
