"""``fuse_decode_rope``: who applies RoPE when the attention backend can.

The Triton decode kernel's own rotation is checked in
``tests/executor/attention/test_triton_interpret.py`` (and ``test_fused_rope_gpu.py`` beside
this file, on a GPU); here, on CPU, the model's side: with a backend that rotates decode
q/k itself, the model must skip its RoPE for exactly those forwards (decode; never
prefill), also through the breakable graph wrapper, and the tokens must equal the plain
path's.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from executor.api import DecodeItem, PrefillItem
from executor.attention.base import AttentionMetadata
from executor.attention.torch_native import TorchNativeBackend, TorchNativeMetadata
from executor.config import CacheConfig, ExecutorConfig
from executor.errors import ConfigError
from executor.executor import Executor
from executor.graphs.backends import BatchScope
from executor.graphs.breakable import BreakingAttention
from executor.model.layers import TorchOps

CONFIG = ExecutorConfig(cache=CacheConfig(kv_tokens=512, max_sequences=4, max_context=128),
                        max_decode_batch=4, max_prefill_tokens=256)


class FusingTorchNative(TorchNativeBackend):
    """torch_native that rotates decode q/k itself, as the Triton decode kernel does:
    at each sequence's new position (its prefix length)."""

    can_fuse_decode_rope: ClassVar[bool] = True

    def __init__(self, inner: TorchNativeBackend) -> None:
        super().__init__(inner.shape, inner.pool, inner.table)
        self.tables: tuple[torch.Tensor, torch.Tensor] | None = None
        self.rotated = 0  # forwards that rotated here

    def fuse_decode_rope(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.tables = (cos, sin)

    def fuses_rope(self, meta: AttentionMetadata) -> bool:
        return self.tables is not None and isinstance(meta, TorchNativeMetadata) \
            and all(n == 1 and prefix > 0 for _, prefix, n, _ in meta.seqs)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                meta: AttentionMetadata) -> torch.Tensor:
        if self.fuses_rope(meta):
            assert isinstance(meta, TorchNativeMetadata) and self.tables is not None
            positions = torch.tensor([prefix for _, prefix, _, _ in meta.seqs])
            q, k = TorchOps().rope(positions, q, k, *self.tables, None, None, 0.0)
            self.rotated += 1
        return super().forward(q, k, v, layer_id, meta)


def _transcript(ex: Executor) -> list[list[int]]:
    prompts = [[3, 9, 27, 81, 243], [5, 25, 125, 113, 53, 7, 8]]
    ids = ["a", "b"]
    out = ex.prefill([PrefillItem(s, p) for s, p in zip(ids, prompts, strict=True)])
    tokens = [[int(o.token_id)] for o in out.outputs]  # type: ignore[arg-type]
    for _ in range(5):
        step = ex.decode([DecodeItem(s, t[-1]) for s, t in zip(ids, tokens, strict=True)])
        for t, o in zip(tokens, step.outputs, strict=True):
            t.append(int(o.token_id))  # type: ignore[arg-type]
    return tokens


def test_the_model_skips_rope_exactly_where_the_backend_rotates() -> None:
    want = _transcript(Executor(CONFIG))
    ex = Executor(CONFIG)
    fusing = FusingTorchNative(ex.attn)  # type: ignore[arg-type]
    ex.attn = ex.forward.attn = fusing  # the facade and the forward share one backend
    fusing.fuse_decode_rope(ex.model.rotary.cos, ex.model.rotary.sin)  # type: ignore[attr-defined]
    calls: list[int] = []
    rope = ex.model.rotary.forward  # type: ignore[attr-defined]

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return rope(*args, **kwargs)

    ex.model.rotary.forward = counted  # type: ignore[attr-defined]
    assert _transcript(ex) == want
    layers = ex.spec.num_layers
    assert fusing.rotated == 5 * layers  # every decode layer rotated in the backend
    assert len(calls) == layers  # the model rotated only for the prefill


def test_breakable_wrapper_answers_for_the_bound_batch() -> None:
    ex = Executor(CONFIG)
    fusing = FusingTorchNative(ex.attn)  # type: ignore[arg-type]
    fusing.fuse_decode_rope(ex.model.rotary.cos, ex.model.rotary.sin)  # type: ignore[attr-defined]
    scope = BatchScope()
    wrapper = BreakingAttention(fusing, object(), scope)  # type: ignore[arg-type]
    assert not wrapper.fuses_rope(AttentionMetadata())  # nothing bound
    ex.prefill([PrefillItem("a", [3, 4, 5])])
    decode = ex.build_batch("decode", [6], ex.kv.allocate([("a", 1)]), [0])
    prefill = ex.build_batch("prefill", [7, 8], ex.kv.allocate([("b", 2)]), [0])
    with scope.bind(fusing.build_metadata(decode), 1):
        assert wrapper.fuses_rope(AttentionMetadata())
    with scope.bind(fusing.build_metadata(prefill), 2):
        assert not wrapper.fuses_rope(AttentionMetadata())


def test_the_flag_needs_a_backend_that_fuses() -> None:
    with pytest.raises(ConfigError, match="triton"):
        Executor(ExecutorConfig(cache=CONFIG.cache, fuse_decode_rope="on"))  # torch_native


def test_auto_fuses_exactly_where_the_backend_can(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default (``auto``) fuses where the backend can rotate and the model has plain
    RoPE, says so in ModelInfo, and leaves RoPE to the model elsewhere or when ``off``."""
    import executor.boot as executor_module

    plain = Executor(CONFIG)  # torch_native cannot rotate: the model does
    assert CONFIG.fuse_decode_rope == "auto"
    assert not plain.fuses_decode_rope and plain.model_info.kernel_features == ()
    real = executor_module.create_backend
    monkeypatch.setattr(executor_module, "create_backend",
                        lambda *args: FusingTorchNative(real(*args)))
    fused = Executor(CONFIG)
    assert isinstance(fused.attn, FusingTorchNative) and fused.attn.tables is not None
    assert fused.fuses_decode_rope and fused.model_info.kernel_features == ("fused_decode_rope",)
    off = Executor(ExecutorConfig(cache=CONFIG.cache, fuse_decode_rope="off"))
    assert isinstance(off.attn, FusingTorchNative) and off.attn.tables is None
    assert not off.fuses_decode_rope
    want = _transcript(plain)
    assert _transcript(fused) == want and fused.attn.rotated > 0
    assert _transcript(off) == want and off.attn.rotated == 0


@pytest.mark.parametrize("field", ["fuse_decode_rope", "pdl", "skinny_row_kernel", "fp8_glu",
                                   "moe_one_launch"])
def test_kernel_switches_take_auto_on_or_off(field: str) -> None:
    with pytest.raises(ConfigError, match=f"{field} must be one of \\['auto', 'on', 'off'\\]"):
        ExecutorConfig(**{field: "yes"})  # type: ignore[arg-type]


def test_pdl_on_is_refused_where_the_device_cannot() -> None:
    with pytest.raises(ConfigError, match=r"--pdl on: .*device cpu is not CUDA"):
        Executor(ExecutorConfig(cache=CONFIG.cache, pdl="on"))


def test_skinny_row_kernel_on_is_refused_off_cuda() -> None:
    with pytest.raises(ConfigError, match=r"--skinny-row-kernel on needs a CUDA device"):
        Executor(ExecutorConfig(cache=CONFIG.cache, skinny_row_kernel="on"))
    off = Executor(ExecutorConfig(cache=CONFIG.cache, skinny_row_kernel="off"))
    assert not off.switches.row_kernel and "skinny_row_kernel" not in off.model_info.kernel_features


def test_moe_one_launch_on_is_refused_off_cuda() -> None:
    with pytest.raises(ConfigError, match=r"--moe-one-launch on needs a CUDA device"):
        Executor(ExecutorConfig(cache=CONFIG.cache, moe_one_launch="on"))


def test_an_executor_holds_its_kernel_switches_around_each_forward_and_sampling() -> None:
    """The PDL and row-kernel switches are process-wide; each executor holds its own
    choices active around every forward and its sampling (and capture), so two executors
    in a process launch as configured, and nothing stays set between calls."""
    from executor.kernels import switches
    from executor.model.llama import CausalLM
    from executor.sampling import Sampler

    ex = Executor(CONFIG)
    assert ex.switches == switches.KernelSwitches(pdl=False, row_kernel=False,
                                                  moe_one_launch=False)
    seen: list[tuple[str, switches.KernelSwitches]] = []
    ex.switches = ex.forward.switches = switches.KernelSwitches(pdl=True, row_kernel=False)
    forward, sample = CausalLM.forward, Sampler.sample

    def spy_forward(self: CausalLM, *args: object, **kwargs: object) -> object:
        seen.append(("forward", switches.active()))
        return forward(self, *args, **kwargs)

    def spy_sample(self: Sampler, *args: object, **kwargs: object) -> object:
        seen.append(("sample", switches.active()))
        return sample(self, *args, **kwargs)  # type: ignore[arg-type]

    CausalLM.forward = spy_forward  # type: ignore[method-assign,assignment]
    Sampler.sample = spy_sample  # type: ignore[method-assign,assignment]
    try:
        ex.prefill([PrefillItem("a", [3, 4, 5])])
        ex.decode([DecodeItem("a", 6)])
    finally:
        CausalLM.forward = forward  # type: ignore[method-assign]
        Sampler.sample = sample  # type: ignore[method-assign]
    assert seen == [("forward", ex.switches), ("sample", ex.switches)] * 2
    assert switches.active() == switches.DEFAULT
