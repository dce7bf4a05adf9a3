"""Routing and the eager experts, in plain torch, op for op as Hugging Face computes them.

``route`` is shared by both paths (softmax, ``topk`` and a division: device ops of fixed
shapes, no host sync). ``experts_reference`` loops over the experts that received tokens
(a host sync: the CPU path and the reference of the fused kernels' tests).
"""

from __future__ import annotations

import torch
from torch import nn


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          weights_in_activation_dtype: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, ids)``, both ``(T, top_k)``: the ``top_k`` experts of each token by its
    router softmax (computed in float32) and their probabilities, divided by their sum with
    ``renormalize``. The weights are float32, rounded through the logits' dtype first with
    ``weights_in_activation_dtype`` (Qwen3-MoE does; Mixtral keeps float32); ids int32."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # (T, E)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if weights_in_activation_dtype:
        weights = weights.to(router_logits.dtype).to(torch.float32)
    return weights, ids.to(torch.int32)


def experts_reference(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                      weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` for ``x`` ``(T, H)``, experts
    ``w_gate_up`` ``(E, 2I, H)`` (gate rows then up rows) and ``w_down`` ``(E, H, I)``.

    As Hugging Face's experts module: each expert's output in the activation dtype, scaled
    by its routing weight (``weights``: float32, as ``route`` returns them) and added into
    the result in the activation dtype, experts in ascending order."""
    out = torch.zeros_like(x)
    hit = torch.zeros(w_gate_up.shape[0], dtype=torch.bool, device=x.device)
    hit[ids.flatten().long()] = True
    for expert in hit.nonzero().flatten().tolist():
        token, slot = torch.where(ids == expert)
        gate, up = nn.functional.linear(x[token], w_gate_up[expert]).chunk(2, dim=-1)
        y = nn.functional.linear(nn.functional.silu(gate) * up, w_down[expert])
        # float32 weights: the product rounds once, as HF's (the weights of a family that
        # rounds them are exact in the activation dtype already)
        out.index_add_(0, token, (y * weights[token, slot, None]).to(x.dtype))
    return out
