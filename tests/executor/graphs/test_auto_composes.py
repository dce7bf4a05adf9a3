"""Every ``auto`` setting composes: for each device x dtype we accept and each attention
backend's capabilities, ``auto`` graph modes resolve to a mode the backend can run, and a
named combination that cannot run is refused in one line naming the flags set.

A CUDA ``torch.device`` can be named without a GPU, so every row runs on CPU; the GPU test
beside this file (``test_auto_composes_gpu.py``) starts such an executor for real.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

import executor.attention.flashinfer_backend as flashinfer_backend
from executor.api import Phase
from executor.attention import available_backends, resolve_backend_name
from executor.attention.base import AttentionBackend, AttentionShape
from executor.attention.flashinfer_backend import FlashInferBackend
from executor.attention.torch_native import TorchNativeBackend
from executor.attention.triton_backend import TritonBackend
from executor.boot import Placement, resolve_modes
from executor.config import ExecutorConfig, GraphConfig, ModelConfig
from executor.errors import ConfigError
from executor.executor import Executor
from executor.graphs.registry import (
    AUTO,
    DISABLED,
    PHASES,
    auto_graph_mode,
    resolve_graph_modes,
    valid_modes,
)
from executor.kernels.switches import KernelSwitches
from service.cli import build_configs, build_parser

# Capabilities read from the classes (no instance: the kernel ones need a GPU to build).
BACKENDS: dict[str, type[AttentionBackend]] = {
    "torch_native": TorchNativeBackend, "triton": TritonBackend, "flashinfer": FlashInferBackend}
DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "float16", "bfloat16")
LLAMA = AttentionShape(32, 8, 64, 0.125)
# Whether a graph mode captures attention, read from the capture backends themselves.
ATTENTION_IN_GRAPH = {"full": True, "breakable": False, "fixed_grid": True,
                      "tc_piecewise": False}


def test_every_backend_is_in_the_matrix() -> None:
    assert set(available_backends()) == set(BACKENDS)
    from executor.graphs.registry import make_capture_backend

    for mode, in_graph in ATTENTION_IN_GRAPH.items():
        made = make_capture_backend(mode, torch.device("cpu"), GraphConfig(), "k")
        assert made.attention_in_graph == in_graph


def _runs(phase: Phase, mode: str, cuda: bool, capturable: frozenset[Phase]) -> bool:
    """Whether ``mode`` can run ``phase`` here with that attention backend."""
    if mode == DISABLED:
        return True
    return cuda and mode in valid_modes(phase) and (
        not ATTENTION_IN_GRAPH[mode] or phase in capturable)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("attention", (AUTO, *BACKENDS))
def test_auto_graph_modes_run_with_every_attention_backend(
        device: str, dtype: str, attention: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flashinfer_backend, "flashinfer_installed", lambda: True)
    cuda = device == "cuda"
    try:
        name = resolve_backend_name(attention, torch.device(device), getattr(torch, dtype),
                                    LLAMA, probe=lambda *_: None)
    except ConfigError as exc:  # a named backend that cannot serve here: refused, by name
        assert attention != AUTO, f"auto found no attention backend for {dtype} on {device}"
        assert repr(attention) in str(exc)
        return
    capturable = BACKENDS[name].capturable
    decode, prefill = resolve_graph_modes(AUTO, AUTO, cuda, capturable, name)
    assert _runs("decode", decode, cuda, capturable)
    assert _runs("prefill", prefill, cuda, capturable)
    assert (decode != DISABLED and prefill != DISABLED) == cuda  # graphs wherever CUDA is
    for phase in PHASES:  # every named mode either runs or is refused naming its flag
        for mode in valid_modes(phase):
            pair = (mode, AUTO) if phase == "decode" else (AUTO, mode)
            if _runs(phase, mode, cuda, capturable):
                assert resolve_graph_modes(*pair, cuda, capturable, name)
            else:
                with pytest.raises(ConfigError, match=f"--{phase}-graph {mode}"):
                    resolve_graph_modes(*pair, cuda, capturable, name)


def test_auto_decode_falls_back_to_breakable_and_says_why() -> None:
    assert auto_graph_mode("decode", True, frozenset({"decode"}), "X") == (
        "full", "preferred for decode on CUDA")
    mode, why = auto_graph_mode("decode", True, frozenset(), "attention backend 'X'")
    assert mode == "breakable"
    assert why == "full would capture attention, and attention backend 'X' cannot be " \
        "captured for decode"
    assert auto_graph_mode("prefill", False, frozenset(PHASES)) == (DISABLED, "no CUDA device")


def _fake_boot(config: ExecutorConfig, backend: str) -> tuple[Placement, object, object]:
    """Boot's steps 1-4 as far as resolution reads them, for a CUDA device named on CPU."""
    at = Placement(torch.device(config.device), getattr(torch, config.model.dtype or "bfloat16"),
                   config.model.dtype or "bfloat16", KernelSwitches())
    w = SimpleNamespace(backend_name=backend, backend_why="triton supports float16 and "
                        "bfloat16, not float32")
    att = SimpleNamespace(attn=BACKENDS[backend])
    return at, w, att


def _cli(*flags: str) -> ExecutorConfig:
    return build_configs(build_parser().parse_args(["serve", "--device", "cuda", *flags]))[0]


def test_cuda_float32_defaults_start_with_breakable_decode_graphs() -> None:
    config = _cli("--dtype", "float32")  # every other setting at its default (auto)
    modes, chosen = resolve_modes(config, *_fake_boot(config, "torch_native"))  # type: ignore[arg-type]
    assert modes == {"decode": "breakable", "prefill": "breakable"}
    assert chosen["attention_backend"].startswith("torch_native (triton supports")
    assert chosen["decode_graph"].startswith("breakable (full would capture attention")
    assert chosen["prefill_graph"] == "breakable (preferred for prefill on CUDA)"


@pytest.mark.parametrize(("flags", "backend", "named", "unnamed"), [
    # The user set --decode-graph and --dtype; attention stayed auto.
    (("--dtype", "float32", "--decode-graph", "full"), "torch_native",
     ("--decode-graph full", "--dtype float32", "--attention-backend auto"),
     ("--attention-backend triton",)),
    # The user named the attention backend; the dtype is the device's default.
    (("--attention-backend", "torch_native", "--decode-graph", "full"), "torch_native",
     ("--decode-graph full", "--attention-backend torch_native"), ("--dtype",)),
    (("--attention-backend", "torch_native", "--prefill-graph", "fixed_grid"),
     "torch_native", ("--prefill-graph fixed_grid", "--attention-backend torch_native"),
     ("--dtype",)),
])
def test_impossible_combination_is_refused_naming_the_flags_set(
        flags: tuple[str, ...], backend: str, named: tuple[str, ...],
        unnamed: tuple[str, ...]) -> None:
    config = _cli(*flags)
    with pytest.raises(ConfigError) as info:
        resolve_modes(config, *_fake_boot(config, backend))  # type: ignore[arg-type]
    message = str(info.value)
    assert "\n" not in message
    assert all(flag in message for flag in named), message
    assert not any(flag in message for flag in unnamed), message


def test_explicit_modes_on_cpu_are_only_checked_by_name() -> None:
    config = ExecutorConfig(graphs=GraphConfig(decode_mode="full", prefill_mode="fixed_grid"))
    at, w, att = _fake_boot(config, "torch_native")
    at = Placement(torch.device("cpu"), torch.float32, "float32", KernelSwitches())
    modes, chosen = resolve_modes(config, at, w, att)  # type: ignore[arg-type]
    assert modes == {"decode": "full", "prefill": "fixed_grid"}
    assert set(chosen) == {"attention_backend"}  # the one setting left at auto


def test_cpu_executor_logs_what_auto_chose_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    config = ExecutorConfig(model=ModelConfig(dtype="float32"),
                            graphs=GraphConfig(decode_mode=AUTO, prefill_mode=AUTO))
    with caplog.at_level(logging.INFO, logger="executor.boot"):
        ex = Executor(config)
    assert ex.status().graphs[0].mode == DISABLED
    lines = [r for r in caplog.records if r.getMessage() == "auto_resolved"]
    assert len(lines) == 1
    assert lines[0].auto == {  # type: ignore[attr-defined]
        "attention_backend": "torch_native (attention backend 'triton' needs a CUDA device; "
                             "use torch_native (or auto) on cpu)",
        "decode_graph": "disabled (no CUDA device)",
        "prefill_graph": "disabled (no CUDA device)"}
