"""``weight_prefetch``: the decode attention kernel prefetching the weights read after it.

The prefetch itself (Hopper's bulk L2 prefetch) runs only on a GPU, where
``tests/gpu/test_weight_prefetch_gpu.py`` checks that it changes no bit. Here, on CPU: the
plan (which bytes of which weights, in the order the step reads them, cut to a budget),
the switch's resolution, and that each layer's plan reaches that layer's decode launch
and no other launch.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from executor.api import DecodeItem, PrefillItem
from executor.attention.torch_native import TorchNativeBackend
from executor.config import CacheConfig, ExecutorConfig
from executor.errors import ConfigError
from executor.executor import Executor
from executor.kernels import l2

CONFIG = ExecutorConfig(cache=CacheConfig(kv_tokens=512, max_sequences=4, max_context=128),
                        max_decode_batch=4, max_prefill_tokens=256)


def test_the_plan_takes_leading_bytes_in_order_up_to_the_budget() -> None:
    a = torch.zeros(64, 8, dtype=torch.bfloat16)  # 1024 bytes
    b = torch.zeros(100, dtype=torch.float32)  # 400 bytes
    c = torch.zeros(7, dtype=torch.bfloat16)  # 14 bytes: less than one 16-byte unit
    whole = l2.plan([a, b], 10_000)
    assert [r.numel() for r in whole] == [1024, 400]
    assert [r.data_ptr() for r in whole] == [a.data_ptr(), b.data_ptr()]
    assert all(r.dtype == torch.uint8 for r in whole)
    cut = l2.plan([a, b], 1024 + 100)  # b's share rounds down to whole 16-byte units
    assert [r.numel() for r in cut] == [1024, 96]
    assert [r.numel() for r in l2.plan([a, b], 1000)] == [992]  # a itself is cut
    assert l2.plan([a, b], 15) == []
    assert [r.numel() for r in l2.plan([a, c, b], 10_000)] == [1024]  # c: nothing to take
    assert len(l2.plan([a, b, a, b], 10_000)) == l2.MAX_REGIONS


def test_the_plan_stops_at_a_weight_it_cannot_read_in_order() -> None:
    a = torch.zeros(64, 8, dtype=torch.bfloat16)
    strided = torch.zeros(8, 64, dtype=torch.bfloat16).t()
    misaligned = torch.zeros(1025, dtype=torch.uint8)[1:]
    assert [r.numel() for r in l2.plan([a, strided, a], 10_000)] == [1024]
    assert l2.plan([misaligned, a], 10_000) == []


def test_launch_args_pad_to_the_kernels_regions() -> None:
    a, b = torch.zeros(32, dtype=torch.uint8), torch.zeros(48, dtype=torch.uint8)
    fallback = torch.zeros(1)
    assert l2.launch_args([a, b], fallback) == [a, 32, b, 48, a, 0]
    assert l2.launch_args([], fallback) == [fallback, 0, fallback, 0, fallback, 0]


def test_prefetch_on_is_refused_where_it_cannot_run() -> None:
    with pytest.raises(ConfigError, match=r"--weight-prefetch on: the 'torch_native' "
                                          r"attention backend cannot"):
        Executor(ExecutorConfig(cache=CONFIG.cache, weight_prefetch="on"))
    with pytest.raises(ConfigError, match="weight_prefetch must be one of"):
        ExecutorConfig(weight_prefetch="yes")
    with pytest.raises(ConfigError, match="weight_prefetch_mib must be > 0"):
        ExecutorConfig(weight_prefetch_mib=0)


class PrefetchingTorchNative(TorchNativeBackend):
    """torch_native that records the plan it is handed and the layers it serves with one,
    as the Triton backend hands each layer's plan to that layer's decode launch."""

    can_prefetch_weights: ClassVar[bool] = True

    def __init__(self, inner: TorchNativeBackend) -> None:
        super().__init__(inner.shape, inner.pool, inner.table)
        self.plans: dict[int, list[torch.Tensor]] = {}

    def prefetch_weights(self, layer_id: int, regions: Any) -> None:
        self.plans[layer_id] = list(regions)


def _with_prefetching_backend(monkeypatch: pytest.MonkeyPatch, budget: int) -> None:
    import executor.executor as executor_module

    real = executor_module.create_backend
    monkeypatch.setattr(executor_module, "create_backend",
                        lambda *args: PrefetchingTorchNative(real(*args)))
    monkeypatch.setattr(l2, "unsupported_reason", lambda device: "")
    monkeypatch.setattr(l2, "default_budget", lambda device: budget)


def test_each_layer_plans_o_gate_up_down_cut_to_the_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where it can, ``auto`` hands every layer the leading bytes of its o_proj, gate_up
    and down weights (the order a decode step reads them) up to the budget: half the L2
    by default, ``weight_prefetch_mib`` when given; ModelInfo says so. ``off`` plans
    nothing; outputs do not depend on it."""
    budget = 40_000
    _with_prefetching_backend(monkeypatch, budget)
    ex = Executor(ExecutorConfig(cache=CONFIG.cache, weight_prefetch="auto"))
    assert isinstance(ex.attn, PrefetchingTorchNative)
    assert "weight_prefetch" in ex.model_info.kernel_features
    layers = list(ex.model.layers)  # type: ignore[attr-defined]
    assert sorted(ex.attn.plans) == list(range(len(layers)))
    for layer_id, layer in enumerate(layers):
        weights = [layer.self_attn.o_proj.weight, layer.mlp.gate_up_proj.weight,
                   layer.mlp.down_proj.weight]
        plan = ex.attn.plans[layer_id]
        assert [r.data_ptr() for r in plan] == [w.data_ptr() for w in weights[:len(plan)]]
        sizes = [w.numel() * w.element_size() for w in weights]
        want, left = [], budget
        for size in sizes:
            if left <= 0:
                break
            want.append(min(size, left))
            left -= want[-1]
        assert [r.numel() for r in plan] == want
    assert ex.weight_prefetch_bytes == budget

    small = Executor(ExecutorConfig(cache=CONFIG.cache, weight_prefetch="on",
                                    weight_prefetch_mib=1 / 64))  # 16 KiB
    assert isinstance(small.attn, PrefetchingTorchNative)
    assert all(sum(r.numel() for r in plan) == 2**14 for plan in small.attn.plans.values())
    off = Executor(ExecutorConfig(cache=CONFIG.cache, weight_prefetch="off"))
    assert isinstance(off.attn, PrefetchingTorchNative) and off.attn.plans == {}
    assert off.weight_prefetch_bytes == 0
    assert "weight_prefetch" not in off.model_info.kernel_features
    tokens = []
    for e in (ex, off):
        out = e.prefill([PrefillItem("a", [3, 9, 27, 81])])
        step = e.decode([DecodeItem("a", int(out.outputs[0].token_id))])  # type: ignore[arg-type]
        tokens.append([out.outputs[0].token_id, step.outputs[0].token_id])
    assert tokens[0] == tokens[1]


def test_the_triton_backend_hands_each_layer_its_own_plan(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode launches of layer ``i`` get layer ``i``'s regions (none for a layer without
    a plan); extend launches get none."""
    import executor.attention.triton_backend as tb
    from executor.attention.base import AttentionShape
    from executor.kv.pool import KVPool, ReqToTokenTable

    shape = AttentionShape(4, 2, 16, 0.25)
    pool = KVPool(2, 64, 2, 16, torch.bfloat16, torch.device("cpu"))
    table = ReqToTokenTable(4, 32, torch.device("cpu"))
    backend = tb.TritonBackend(shape, pool, table)
    regions = [torch.zeros(64, dtype=torch.uint8), torch.zeros(32, dtype=torch.uint8)]
    backend.prefetch_weights(1, regions)
    with pytest.raises(ValueError, match="at most 3 prefetch regions"):
        backend.prefetch_weights(0, regions * 2)
    seen: list[tuple[int, tuple[torch.Tensor, ...]]] = []
    monkeypatch.setattr(tb, "decode_attention",
                        lambda *args: seen.append((len(seen), args[-1])))
    table.device_table[0, :3] = torch.tensor([1, 2, 3], dtype=torch.int32)
    one = torch.ones(1, dtype=torch.int64)
    meta = tb.TritonDecodeMetadata(one * 0, one * 3, one * 3, None, None)
    q = torch.zeros(1, 4, 16, dtype=torch.bfloat16)
    kv = torch.zeros(1, 2, 16, dtype=torch.bfloat16)
    for layer_id in (0, 1):
        backend.forward(q, kv, kv, layer_id, meta)
    assert seen[0][1] == ()
    assert len(seen[1][1]) == 2 and all(a is b for a, b in zip(seen[1][1], regions,
                                                                 strict=True))
    backend.prefetch_weights(1, [])
    backend.forward(q, kv, kv, 1, meta)
    assert seen[2][1] == ()
