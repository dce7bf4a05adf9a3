"""The decoder's hand-off of tensor-parallel all-reduces to the projections around them
(``TensorParallel.push_sum`` -> ``PendingSum`` -> the next norm's projection), on CPU.

The kernels that push and gather run only on GPUs (``tests/gpu/test_tensor_parallel_gpus.py``
checks them bit for bit against the all-reduce kernel); here a stand-in ``push_sum`` computes
the same sum eagerly (a world of one: the partial row is the sum), so the layers' wiring
can be checked: which projections push, to which site, who consumes, and that the logits
are exactly those of the unfused path."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from executor.distributed.group import PendingSum, TensorParallel
from executor.model.layers import TORCH_OPS, TorchOps
from tests.test_model_vs_hf import extend_logits, make_executor


@dataclasses.dataclass(frozen=True)
class _Eager(PendingSum):
    value: torch.Tensor | None = None

    def norm_linear(self, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                    layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.value is not None
        return TORCH_OPS.add_rms_norm_linear(self.value, residual, norm_weight, eps, layer)


def test_row_parallel_sums_go_to_the_next_projection(model_dirs: dict[str, Path],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    ex = make_executor(model_dirs["llama"])
    layers = list(ex.model.layers)  # type: ignore[attr-defined]
    n = len(layers)
    tokens = [3, 17, 99, 4]
    want = extend_logits(ex, {"a": tokens})["a"]
    calls: list[tuple[Any, ...]] = []

    def push_sum(self: TensorParallel, x: torch.Tensor, layer: torch.nn.Module, site: int,
                 consumer: torch.nn.Module, norm_weight: torch.Tensor,
                 silu_mul: bool = False) -> PendingSum:
        calls.append((site, silu_mul, layer, consumer, norm_weight))
        value = layer(TORCH_OPS.silu_and_mul(x) if silu_mul else x)
        return _Eager(None, value)  # type: ignore[arg-type]

    monkeypatch.setattr(TensorParallel, "push_sum", push_sum)
    monkeypatch.setattr(TorchOps, "fuses_reductions", True)
    got = extend_logits(ex, {"b": tokens})["b"]
    assert torch.equal(got, want)  # the same sums, handed over instead of returned
    # o_proj -> this layer's gate_up at site 0; down -> the next layer's qkv at site 1,
    # except in the last layer (the final norm is no projection: a plain all-reduce)
    expected = []
    for i, layer in enumerate(layers):
        expected.append((0, False, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                         layer.post_attention_layernorm.weight))
        if i + 1 < n:
            nxt = layers[i + 1]
            expected.append((1, True, layer.mlp.down_proj, nxt.self_attn.qkv_proj,
                             nxt.input_layernorm.weight))
    assert len(calls) == len(expected) == 2 * n - 1
    for got_call, want_call in zip(calls, expected, strict=True):
        assert got_call[:2] == want_call[:2]
        assert all(a is b for a, b in zip(got_call[2:], want_call[2:], strict=True))


def test_without_fused_sites_nothing_is_pushed() -> None:
    """A world without reduce sites (here the world of one) declines: the caller
    all-reduces as before."""
    tp = TensorParallel.single()
    lin = torch.nn.Linear(8, 8, bias=False)
    assert tp.push_sum(torch.ones(1, 8), lin, 0, lin, torch.ones(8)) is None
