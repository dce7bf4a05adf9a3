"""Which attention backend serves: ``--attention-backend`` resolution, table-driven.

FlashInfer's presence and its on-device probe are replaced here (the real probe needs a GPU
with FlashInfer installed; ``test_flashinfer_gpu.py`` beside this file runs it there). A
CUDA ``torch.device`` can be named without a GPU, so every row runs on CPU.
"""

from __future__ import annotations

import logging

import pytest
import torch

import executor.attention.flashinfer_backend as flashinfer_backend
from executor.attention import resolve_backend_name
from executor.attention.base import AttentionShape
from executor.config import ExecutorConfig, ModelConfig
from executor.errors import ConfigError
from executor.executor import Executor

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
BF16, F32 = torch.bfloat16, torch.float32
LLAMA = AttentionShape(32, 8, 64, 0.125)  # Llama-3.2-1B
ODD_HEAD = AttentionShape(8, 8, 96, 96**-0.5)

WORKS = None
BROKEN = "FlashInfer failed a probe attention on cuda: RuntimeError: no kernel image"


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flashinfer_backend, "flashinfer_installed", lambda: True)


@pytest.fixture
def missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flashinfer_backend, "flashinfer_installed", lambda: False)


# requested, device, dtype, shape, probe result -> backend (installed)
INSTALLED_TABLE = [
    # auto never picks FlashInfer (measured slower than Triton in most configurations)
    ("auto", CUDA, BF16, LLAMA, WORKS, "triton"),
    ("auto", CUDA, BF16, LLAMA, BROKEN, "triton"),
    ("auto", CUDA, BF16, ODD_HEAD, WORKS, "triton"),  # head size FlashInfer lacks
    ("auto", CUDA, F32, LLAMA, WORKS, "torch_native"),  # neither kernel does fp32
    ("auto", CPU, F32, LLAMA, WORKS, "torch_native"),
    ("triton", CUDA, BF16, LLAMA, WORKS, "triton"),
    ("torch_native", CUDA, BF16, LLAMA, WORKS, "torch_native"),
    ("flashinfer", CUDA, torch.float16, LLAMA, WORKS, "flashinfer"),
]


@pytest.mark.usefixtures("installed")
@pytest.mark.parametrize(("requested", "device", "dtype", "shape", "probe_says", "expect"),
                         INSTALLED_TABLE)
def test_resolution_with_flashinfer_installed(requested: str, device: torch.device,
                                              dtype: torch.dtype, shape: AttentionShape,
                                              probe_says: str | None, expect: str) -> None:
    probed: list[tuple[torch.device, torch.dtype, AttentionShape]] = []

    def probe(d: torch.device, t: torch.dtype, s: AttentionShape) -> str | None:
        probed.append((d, t, s))
        return probe_says

    assert resolve_backend_name(requested, device, dtype, shape, probe) == expect
    # The probe (which compiles kernels on a GPU) runs only when FlashInfer is named.
    candidate = requested == "flashinfer" and device.type == "cuda" \
        and dtype != F32 and shape.head_dim in flashinfer_backend.FLASHINFER_HEAD_DIMS
    assert probed == ([(device, dtype, shape)] if candidate else [])


@pytest.mark.parametrize("flashinfer_installed", [True, False])
def test_auto_picks_triton_on_cuda_and_never_probes_flashinfer(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        flashinfer_installed: bool) -> None:
    monkeypatch.setattr(flashinfer_backend, "flashinfer_installed", lambda: flashinfer_installed)

    def probe(*_: object) -> str | None:
        raise AssertionError("auto must not probe FlashInfer")

    with caplog.at_level(logging.INFO, logger="executor.attention"):
        assert resolve_backend_name("auto", CUDA, BF16, LLAMA, probe) == "triton"
    assert caplog.records == []


# requested, device, dtype, shape, probe result -> error text (installed)
ERRORS = [
    ("flashinfer", CPU, F32, LLAMA, WORKS, "needs a CUDA device; use torch_native"),
    ("flashinfer", CUDA, F32, LLAMA, WORKS, "supports float16 and bfloat16, not torch.float32"),
    ("flashinfer", CUDA, BF16, ODD_HEAD, WORKS, r"head_dim \[64, 128, 256\], not 96"),
    ("flashinfer", CUDA, BF16, LLAMA, BROKEN, "cannot serve here: FlashInfer failed a probe"),
    ("triton", CPU, F32, LLAMA, WORKS, "'triton' needs a CUDA device"),
    ("triton", CUDA, F32, LLAMA, WORKS, "'triton' supports float16 and bfloat16"),
    ("flash", CUDA, BF16, LLAMA, WORKS,
     "unknown attention backend 'flash'; valid: auto, torch_native, triton, flashinfer"),
]


@pytest.mark.usefixtures("installed")
@pytest.mark.parametrize(("requested", "device", "dtype", "shape", "probe_says", "error"),
                         ERRORS)
def test_named_backend_that_cannot_serve_is_a_startup_error(
        requested: str, device: torch.device, dtype: torch.dtype, shape: AttentionShape,
        probe_says: str | None, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        resolve_backend_name(requested, device, dtype, shape, lambda *_: probe_says)


@pytest.mark.usefixtures("missing")
def test_flashinfer_not_installed_says_how_to_install() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_backend_name("flashinfer", CUDA, BF16, LLAMA)
    message = str(info.value)
    assert "flashinfer package is not installed" in message
    assert "pip install 'model-executor[flashinfer]'" in message
    assert "docs/flashinfer.md" in message


def test_executor_refuses_the_backend_before_loading_weights(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*_: object, **__: object) -> None:
        raise AssertionError("weights loaded before the attention backend was settled")

    monkeypatch.setattr("executor.boot.load_model", never)
    config = ExecutorConfig(model=ModelConfig(), device="cpu", attention_backend="flashinfer")
    with pytest.raises(ConfigError, match="'flashinfer' needs a CUDA device"):
        Executor(config)


def test_model_info_names_the_resolved_backend() -> None:
    ex = Executor(ExecutorConfig(model=ModelConfig(), device="cpu"))  # auto
    assert ex.model_info.attention_backend == "torch_native" == ex.attn.name
