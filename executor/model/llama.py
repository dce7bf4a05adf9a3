"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3) over our KV pools.

Tokens are packed: every tensor is ``(T, ...)`` for the ``T`` new tokens of a batch, with
no padding and no batch dimension. Attention is delegated to an ``AttentionBackend``; the
model never sees how sequences are laid out, only the metadata object it passes along.

Layers thread ``(hidden, residual)`` (vLLM-style): each layer returns its MLP output and
the residual stream *without* adding them; the next layer's input norm (or the final
norm) does the add and the norm in one step, the same sums as Hugging Face's
``residual + hidden`` in the same dtype. The element-wise work between the matmuls goes
through a ``LayerOps`` picked once per forward (``select_ops``): fused Triton kernels on
CUDA for fp16/bf16 (at one row each norm fused into the GEMM after it and SiLU-and-mul
into down: ``executor.kernels.skinny``; an FP8 gate_up below 8 rows ends in SiLU-and-mul
itself instead: ``executor.quant``), plain torch else. Under tensor parallelism o_proj and
down_proj are row-parallel (``TensorParallel.linear_all_reduce``).
"""

from __future__ import annotations

import torch
from torch import nn

from executor.attention.base import AttentionBackend, AttentionMetadata
from executor.distributed.group import TensorParallel
from executor.model.base import register_model
from executor.model.layers import (
    GatedMLP,
    KernelChoice,
    LayerOps,
    RMSNorm,
    RotaryEmbedding,
    prepare_kernels,
    select_ops,
)
from executor.model.spec import ARCHITECTURES, ModelSpec
from executor.model.vocab_parallel import ParallelLMHead, VocabParallelEmbedding


class Attention(nn.Module):
    """This rank's heads (``spec`` is per rank under tensor parallelism): the QKV rows of
    its heads, the o_proj columns that read them, and an all-reduce of the partial sums."""

    def __init__(self, spec: ModelSpec, layer_id: int, rotary: RotaryEmbedding,
                 tp: TensorParallel) -> None:
        super().__init__()
        self.layer_id, self.tp = layer_id, tp
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
                meta: AttentionMetadata, ops: LayerOps) -> torch.Tensor:
        return self.attend(positions, ops.linear(self.qkv_proj, x), backend, meta, ops)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, backend: AttentionBackend,
               meta: AttentionMetadata, ops: LayerOps) -> torch.Tensor:
        """Everything after the qkv projection: ``qkv`` ``(T, q + 2 * kv)`` -> ``(T, hidden)``,
        all-reduced over the ranks."""
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # strided views of the QKV output
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if not backend.fuses_rope(meta):  # else its decode kernel rotates q and k
            q, k = self.rotary(positions, q, k, ops, self.q_norm, self.k_norm)  # (qk norm +) RoPE
        out = backend.forward(q, k, v, self.layer_id, meta).reshape(t, self.q_size)
        return self.tp.linear_all_reduce(self.o_proj, out, lambda: ops.linear(self.o_proj, out),
                                         send=ops.gemm_sends)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_id: int, rotary: RotaryEmbedding,
                 tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, layer_id, rotary, tp)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = GatedMLP(spec.hidden_size, spec.intermediate_size)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, backend: AttentionBackend,
                meta: AttentionMetadata, ops: LayerOps) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden``: the previous layer's MLP output (the embeddings for the first layer,
        with ``residual=None``); returns ``(mlp_out, residual)``, not yet added. Each norm
        goes with the projection after it (``linear_forward``: one kernel where the ops
        fuse them). Where the gate_up projection has the gated epilogue for these rows
        (FP8 decode, ``glu_linear_forward``), SiLU-and-mul comes out of it and down_proj
        takes a plain input; else down_proj computes SiLU-and-mul (fused into its GEMM
        where it can). Under tensor parallelism o_proj and down_proj are row-parallel:
        their partial sums are all-reduced (each rank's gate_up rows are its [gate; up]
        shards, so the epilogue pairs them per rank)."""
        qkv, residual = self.input_layernorm.linear_forward(
            hidden, residual, self.self_attn.qkv_proj, ops)
        attn = self.self_attn.attend(positions, qkv, backend, meta, ops)
        glu = self.post_attention_layernorm.glu_linear_forward(
            attn, residual, self.mlp.gate_up_proj, ops)
        if glu is not None:
            act, residual = glu  # (T, intermediate): silu(gate) * up
            down = self.tp.linear_all_reduce(self.mlp.down_proj, act,
                                             lambda: ops.linear(self.mlp.down_proj, act),
                                             send=ops.gemm_sends)
            return down, residual
        gate_up, residual = self.post_attention_layernorm.linear_forward(
            attn, residual, self.mlp.gate_up_proj, ops)
        down = self.tp.linear_all_reduce(self.mlp.down_proj, gate_up,
                                         lambda: self.mlp.down(gate_up, ops), silu_mul=True,
                                         send=ops.gemm_sends)
        return down, residual


@register_model(*(arch for arch, f in ARCHITECTURES.items() if not f.gemma_norms))
class CausalLM(nn.Module):
    """Decoder plus LM head. ``forward`` returns final hidden states ``(T, hidden)``;
    ``compute_logits`` turns selected rows into logits ``(S, vocab)`` in the activation
    dtype.

    ``kernels`` picks the implementation of the element-wise ops (``KernelChoice``):
    the default ``"auto"`` uses the fused Triton kernels for CUDA fp16/bf16 activations
    and plain torch otherwise. Both paths are traceable by Dynamo (the kernels are
    custom ops with fake impls under ``torch.compile``); ``"torch"`` leaves the fusion to
    the compiler instead. It is read at every forward: set it before capturing graphs.

    Under tensor parallelism (``tp``, ``executor/distributed``) ``spec`` is one rank's
    shape (``sharding.local_spec``), the embedding and LM head hold a slice of the
    vocabulary, and ``compute_logits`` still returns the full vocabulary on every rank.
    """

    def __init__(self, spec: ModelSpec, max_positions: int, kernels: KernelChoice = "auto",
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        tp = tp or TensorParallel.single()
        prepare_kernels(kernels)
        self.spec = spec
        self.kernels: KernelChoice = kernels
        self.rotary = RotaryEmbedding(spec.rope, spec.head_dim, max_positions)
        self.embed_tokens: nn.Embedding | VocabParallelEmbedding
        self.lm_head: nn.Linear | ParallelLMHead
        if tp.distributed:
            self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, tp,
                                                       kernels)
            self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, tp)
        else:
            self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
            self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.layers = nn.ModuleList(self.make_layer(spec, i, tp) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def make_layer(self, spec: ModelSpec, layer_id: int, tp: TensorParallel) -> nn.Module:
        """Decoder layer ``layer_id`` (a family that changes the MLP overrides this)."""
        return DecoderLayer(spec, layer_id, self.rotary, tp)

    def materialize(self, dtype: torch.dtype, device: torch.device) -> None:
        """Give the parameters (built on the meta device) real, uninitialized storage in
        ``dtype`` on ``device``, and make the buffers the checkpoint does not fill."""
        self.to(dtype).to_empty(device=device)
        if self.spec.tie_word_embeddings:  # to_empty unties: tie again
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary.init_tables(device)

    @property
    def hidden_dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                backend: AttentionBackend, meta: AttentionMetadata) -> torch.Tensor:
        ops = select_ops(self.kernels, self.embed_tokens.weight)
        embedded = ops.embed(self.embed_tokens, input_ids)  # (T, hidden)
        hidden: torch.Tensor = embedded
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, backend, meta, ops)
        if residual is None:  # no layers
            return self.norm(embedded, ops)
        return self.norm.add_forward(hidden, residual, ops)[0]

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None
                       ) -> torch.Tensor:
        """Logits ``(S, vocab)`` of ``hidden`` ``(S, hidden)`` in the activation dtype, the
        LM head's output as is: whoever needs float32 widens the rows it reads (the sampler;
        bf16/fp16 -> float32 is exact). With ``out`` (a buffer of the activation dtype), its
        rows ``:S``, returned as that view.

        NOTE: no float32 cast here: it would be one more vocabulary-wide copy kernel per
        decode step, for a widening the sampler does on the rows it reads anyway."""
        dst = None if out is None else out[: hidden.shape[0]]  # (S, vocab)
        if isinstance(self.lm_head, nn.Linear) and self.lm_head.bias is None:
            # The GEMM writes the buffer itself (no copy kernel after it); at one row the
            # row kernel where it takes the shape (``LayerOps.logits``), eager or captured.
            return select_ops(self.kernels, hidden).logits(self.lm_head, hidden, dst)
        if dst is None:
            return self.lm_head(hidden)  # type: ignore[no-any-return]
        dst.copy_(self.lm_head(hidden))  # vocabulary-parallel: the gathered logits are new
        return dst
