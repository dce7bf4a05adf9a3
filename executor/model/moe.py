"""Mixture-of-experts families (Qwen3-MoE, Mixtral): the Llama decoder with a sparse block.

A sparse layer's MLP is ``SparseMoeBlock``: a linear router (``gate``, replicated under
tensor parallelism), softmax and top-k on the device (``kernels.moe.reference.route``),
then the experts, whose weights are stacked per layer: ``experts.gate_up_proj``
``(E, 2I, H)`` and ``experts.down_proj`` ``(E, H, I)`` (``I`` this rank's share of each
expert's width; the partial sums are all-reduced like a dense MLP's). Layers the config
keeps dense (``MoeSpec.dense_layers``) are the Llama family's ``DecoderLayer``.

Which experts implementation runs is ``experts_path``: the fused Triton kernels on CUDA
(no host sync, capturable) or when the kernels are forced (``kernels="triton"``, the
interpreter's tests); the eager reference elsewhere (CPU). On the fused kernels' decode
path (``SparseMoeBlock.fuses_norm``) the layer's post-attention norm goes with the router
GEMM (``linear_forward``) and the experts normalize the residual sum themselves.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from executor.attention.base import AttentionBackend, AttentionMetadata
from executor.distributed.group import TensorParallel
from executor.kernels.moe.reference import experts_reference, route
from executor.model.base import register_model
from executor.model.layers import (
    TRITON_OPS,
    KernelChoice,
    LayerOps,
    RMSNorm,
    RotaryEmbedding,
)
from executor.model.llama import Attention, CausalLM
from executor.model.spec import MOE_ARCHITECTURES, ModelSpec, MoeSpec

ExpertsPath = Literal["fused", "eager"]


def experts_path(x: torch.Tensor, ops: LayerOps) -> ExpertsPath:
    """The fused kernels on CUDA whatever the model's ``kernels`` choice (the eager loop
    reads the routing back to the host: no graph could hold it), and wherever the layer
    ops are the kernels (``kernels="triton"`` on CPU: the interpreter); else (CPU) the
    eager reference."""
    return "fused" if x.is_cuda or ops is TRITON_OPS else "eager"


class Experts(nn.Module):
    """``num_experts`` SwiGLU experts stacked: ``gate_up_proj`` ``(E, 2I, H)`` (each
    expert's gate rows, then its up rows) and ``down_proj`` ``(E, H, I)``. FP8 checkpoints
    load into ``executor.quant.experts.Fp8Experts`` instead (same weights, e4m3, with
    scales); both say what the fused kernels take besides the weights (``kernel_args``)."""

    def __init__(self, num_experts: int, inter: int, hidden: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))

    def kernel_args(self) -> dict[str, Any]:
        return {}


class SparseMoeBlock(nn.Module):
    def __init__(self, moe: MoeSpec, hidden: int) -> None:
        super().__init__()
        self.moe = moe
        self.gate = nn.Linear(hidden, moe.num_experts, bias=False)  # the router
        # (the FP8 loader may swap in an ``Fp8Experts``: the same attributes)
        self.experts = Experts(moe.num_experts, moe.intermediate_size, hidden)

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        """``x`` ``(T, hidden)`` (normed) -> this rank's partial sum ``(T, hidden)``."""
        logits = ops.linear(self.gate, x)  # (T, E) in the activation dtype, as HF's
        w13, w2 = self.experts.gate_up_proj, self.experts.down_proj
        moe = self.moe
        if experts_path(x, ops) == "fused":  # routing in the kernels, then the experts
            return self.fused_experts(x, logits, None)
        weights, ids = route(logits, moe.top_k, moe.renormalize,
                             moe.weights_in_activation_dtype)
        return experts_reference(x, w13, w2, weights, ids)

    def fuses_norm(self, x: torch.Tensor, ops: LayerOps) -> bool:
        """Whether the experts take ``x``'s norm themselves (``fused_experts`` with a
        norm): the fused kernels' decode path (``kernels.moe.decode.takes``), outside a
        Dynamo trace (a shape test there would guard on the token count)."""
        if torch.compiler.is_compiling() or experts_path(x, ops) != "fused":
            return False
        from executor.kernels.moe import decode

        return decode.takes(x.shape[0], self.moe.top_k, self.moe.num_experts)

    def fused_experts(self, x: torch.Tensor, logits: torch.Tensor, norm: RMSNorm | None
                      ) -> torch.Tensor:
        """The fused kernels on ``x`` routed by ``logits``; with ``norm``, ``x`` is the
        residual sum and the experts read ``norm(x)`` (``fuses_norm``)."""
        from executor.kernels.moe import fused

        moe = self.moe
        return fused.fused_moe(x, logits, self.experts.gate_up_proj, self.experts.down_proj,
                               moe.top_k, moe.renormalize, moe.weights_in_activation_dtype,
                               norm.weight if norm is not None else None,
                               norm.eps if norm is not None else 0.0,
                               **self.experts.kernel_args())


class MoeDecoderLayer(nn.Module):
    """``DecoderLayer`` with ``SparseMoeBlock`` as its MLP (same ``forward`` contract)."""

    def __init__(self, spec: ModelSpec, layer_id: int, rotary: RotaryEmbedding,
                 tp: TensorParallel) -> None:
        super().__init__()
        assert spec.moe is not None
        self.tp = tp
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, layer_id, rotary, tp)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = SparseMoeBlock(spec.moe, spec.hidden_size)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, backend: AttentionBackend,
                meta: AttentionMetadata, ops: LayerOps) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = self.input_layernorm.linear_forward(
            hidden, residual, self.self_attn.qkv_proj, ops)
        attn = self.self_attn.attend(positions, qkv, backend, meta, ops)
        norm = self.post_attention_layernorm
        if self.mlp.fuses_norm(attn, ops):  # the norm in the router GEMM and the experts
            logits, residual = norm.linear_forward(attn, residual, self.mlp.gate, ops)
            out = self.mlp.fused_experts(residual, logits, norm)
        else:
            normed, residual = norm.add_forward(attn, residual, ops)
            out = self.mlp(normed, ops)
        return self.tp.all_reduce(out), residual


@register_model(*MOE_ARCHITECTURES)
class MoeCausalLM(CausalLM):
    """``CausalLM`` whose sparse layers are ``MoeDecoderLayer``s (``spec.moe``)."""

    def __init__(self, spec: ModelSpec, max_positions: int, kernels: KernelChoice = "auto",
                 tp: TensorParallel | None = None) -> None:
        if spec.moe is None:
            raise ValueError(f"{spec.architecture} spec has no MoE block")
        super().__init__(spec, max_positions, kernels, tp)

    def make_layer(self, spec: ModelSpec, layer_id: int, tp: TensorParallel) -> nn.Module:
        assert spec.moe is not None
        if not spec.moe.sparse(layer_id):
            return super().make_layer(spec, layer_id, tp)
        return MoeDecoderLayer(spec, layer_id, self.rotary, tp)
