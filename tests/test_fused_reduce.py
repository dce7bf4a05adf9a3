"""``fuse_decode_reduce``: which executors merge split-KV decode attention in the split
kernel, and how the switch reaches the attention backend.

The kernel itself (the last split program merging, its counters, any program order) is
checked under Triton's interpreter in ``tests/test_triton_interpret.py``; here, on CPU
without Triton, the switch: ``auto`` fuses on CUDA only, ``on`` fuses wherever the backend
can (the interpreter runs it) and is refused elsewhere, ``off`` never, and the flags of
the CLI and of the benchmarks set it.
"""

from __future__ import annotations

import argparse
from typing import ClassVar

import pytest

from bench import switches
from executor.attention.torch_native import TorchNativeBackend
from executor.config import CacheConfig, ExecutorConfig
from executor.errors import ConfigError
from executor.executor import Executor
from service.cli import build_configs, build_parser

CONFIG = ExecutorConfig(cache=CacheConfig(kv_tokens=512, max_sequences=4, max_context=128),
                        max_decode_batch=4, max_prefill_tokens=256)


class MergingTorchNative(TorchNativeBackend):
    """torch_native that says it can merge split-KV decode in one launch (as Triton's
    can), recording whether the executor asked it to."""

    can_fuse_decode_reduce: ClassVar[bool] = True

    def __init__(self, inner: TorchNativeBackend) -> None:
        super().__init__(inner.shape, inner.pool, inner.table)
        self.asked = 0

    def fuse_decode_reduce(self) -> None:
        self.asked += 1


def test_on_needs_a_backend_that_fuses() -> None:
    assert not TorchNativeBackend.can_fuse_decode_reduce
    with pytest.raises(ConfigError, match="--fuse-decode-reduce on needs the triton"):
        Executor(ExecutorConfig(cache=CONFIG.cache, fuse_decode_reduce="on"))


@pytest.mark.parametrize(("mode", "fuses"), [("auto", False), ("on", True), ("off", False)])
def test_the_switch_reaches_a_backend_that_can(mode: str, fuses: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` does not fuse (it measured slower); ``on`` asks the backend once and says
    so in ModelInfo; ``off`` does not ask."""
    import executor.executor as executor_module

    real = executor_module.create_backend
    monkeypatch.setattr(executor_module, "create_backend",
                        lambda *args: MergingTorchNative(real(*args)))
    ex = Executor(ExecutorConfig(cache=CONFIG.cache, fuse_decode_reduce=mode))
    assert isinstance(ex.attn, MergingTorchNative)
    assert ex.fuses_decode_reduce is fuses and ex.attn.asked == int(fuses)
    assert ("fused_decode_reduce" in ex.model_info.kernel_features) is fuses
    plain = Executor(CONFIG)  # torch_native itself: never
    assert not plain.fuses_decode_reduce
    assert "fused_decode_reduce" not in plain.model_info.kernel_features


def test_cli_and_bench_flags_set_it() -> None:
    cfg, _ = build_configs(build_parser().parse_args(["serve", "--device", "cpu"]))
    assert cfg.fuse_decode_reduce == "auto"
    cfg, _ = build_configs(build_parser().parse_args(
        ["serve", "--device", "cpu", "--fuse-decode-reduce", "off"]))
    assert cfg.fuse_decode_reduce == "off"
    ap = argparse.ArgumentParser()
    switches.add_arguments(ap)
    assert "fuse_decode_reduce" in switches.SWITCHES
    assert switches.overrides(ap.parse_args(["--fuse-decode-reduce", "on"])) == {
        "fuse_decode_reduce": "on"}
    assert switches.overrides(ap.parse_args([])) == {}
