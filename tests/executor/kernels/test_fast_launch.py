"""``FastLauncher``: when it launches through the JIT and when straight to the compiled
kernel, with what arguments, and when it gives the fast path up.

A stand-in for a ``@triton.jit`` function records both kinds of launch, so this runs on
any machine; ``test_kernels_gpu.py`` (beside this file) checks the real kernels' fast
launches against their JIT launches on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from executor.errors import ConfigError
from executor.kernels import fast_launch as launch
from executor.kernels.fast_launch import FastLauncher, cdiv, next_power_of_2


@dataclass
class Param:
    name: str
    is_constexpr: bool


@dataclass
class FakeCompiled:
    runs: list[tuple[Any, ...]] = field(default_factory=list)
    function: int = 7
    packed_metadata: tuple[int, ...] = (1, 2)

    def run(self, *args: Any) -> None:
        self.runs.append(args)


class FakeJit:
    """``fn[grid](*args, **kwargs)`` records the call and returns one compiled kernel."""

    def __init__(self, params: list[Param], do_not_specialize: tuple[str, ...] = ()) -> None:
        self.params = params
        self.do_not_specialize = list(do_not_specialize)
        self.compiled = FakeCompiled()
        self.jit_calls: list[tuple[tuple[int, ...], tuple[Any, ...], dict[str, Any]]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def call(*args: Any, **kwargs: Any) -> FakeCompiled:
            self.jit_calls.append((grid, args, kwargs))
            return self.compiled
        return call


PARAMS = [Param("x_ptr", False), Param("n", False), Param("BLOCK", True), Param("FLAG", True)]


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """CPU tensors pass for CUDA device 0; the raw stream lookup records its device."""
    streams: list[int] = []

    def raw_stream(device: int) -> int:
        streams.append(device)
        return 99

    monkeypatch.setattr(launch, "_cuda_index", lambda tensors: 0 if tensors else None)
    monkeypatch.setattr(launch, "_raw_stream", raw_stream)
    monkeypatch.setattr(launch, "_launch_hooks_set", lambda: False)
    return streams


def make(params: list[Param] = PARAMS, do_not_specialize: tuple[str, ...] = ()
         ) -> tuple[FakeJit, FastLauncher]:
    fn = FakeJit(params, do_not_specialize)
    launcher = FastLauncher(fn, num_warps=4)
    launcher.enabled, launcher.disabled_reason = True, ""  # also under TRITON_INTERPRET
    return fn, launcher


def test_first_launch_of_a_key_goes_through_the_jit_later_ones_straight_to_the_kernel(
        fake_cuda: list[int]) -> None:
    fn, launcher = make()
    x = torch.zeros(4)
    constexprs = {"FLAG": True, "BLOCK": 64}  # any order: the signature decides
    launcher.launch((3, 1, 1), "k", (x, 5), constexprs)
    assert fn.jit_calls == [((3, 1, 1), (x, 5), {"FLAG": True, "BLOCK": 64, "num_warps": 4})]
    assert launcher.fast_launches == 0 and fn.compiled.runs == []

    y = torch.ones(8)
    launcher.launch((2, 4, 1), "k", (y, 6), constexprs)
    assert len(fn.jit_calls) == 1 and launcher.fast_launches == 1
    # grid, stream, function, metadata, no launch metadata or hooks, then every parameter
    # in signature order: tensors as raw pointers, constexprs last.
    assert fn.compiled.runs == [(2, 4, 1, 99, 7, (1, 2), None, None, None,
                                 y.data_ptr(), 6, 64, True)]
    assert fake_cuda == [0]


def test_a_new_key_launches_through_the_jit_again(fake_cuda: list[int]) -> None:
    fn, launcher = make()
    x = torch.zeros(4)
    for key in ("a", "b", "a", "b"):
        launcher.launch((1, 1, 1), key, (x, 1), {"BLOCK": 16, "FLAG": False})
    assert len(fn.jit_calls) == 2 and launcher.fast_launches == 2


def test_active_launch_hooks_keep_every_launch_on_the_jit(
        fake_cuda: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "_launch_hooks_set", lambda: True)
    fn, launcher = make()
    x = torch.zeros(4)
    for _ in range(3):
        launcher.launch((1, 1, 1), "k", (x, 1), {"BLOCK": 16, "FLAG": False})
    assert len(fn.jit_calls) == 3 and launcher.fast_launches == 0


def test_hook_chains_count_only_when_they_hold_a_hook() -> None:
    class Chain:
        def __init__(self, calls: list[Any]) -> None:
            self.calls = calls

    assert not launch._active(None)
    assert not launch._active(Chain([]))
    assert launch._active(Chain([print]))
    assert launch._active(print)  # Triton < 3.5: a plain callable


@pytest.mark.parametrize("params", [
    [Param("x_ptr", False), Param("BLOCK", True), Param("n", False), Param("FLAG", True)],
    [Param("x_ptr", False), Param("n", False), Param("BLOCK", True)],
], ids=["constexpr-between-runtime-params", "constexprs-differ"])
def test_a_signature_it_cannot_order_disables_the_fast_path(
        fake_cuda: list[int], params: list[Param]) -> None:
    fn, launcher = make(params)
    x = torch.zeros(4)
    for _ in range(3):
        launcher.launch((1, 1, 1), "k", (x, 1), {"BLOCK": 16, "FLAG": False})
    assert len(fn.jit_calls) == 3 and launcher.fast_launches == 0
    assert not launcher.enabled and "do not match" in launcher.disabled_reason


def test_tensors_off_cuda_disable_the_fast_path() -> None:
    fn, launcher = make()
    x = torch.zeros(4)  # a CPU tensor, no stand-in for CUDA
    for _ in range(2):
        launcher.launch((1, 1, 1), "k", (x, 1), {"BLOCK": 16, "FLAG": False})
    assert len(fn.jit_calls) == 2 and launcher.fast_launches == 0
    assert "not one CUDA device" in launcher.disabled_reason


def test_interpreter_runs_everything_through_the_jit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launcher = FastLauncher(FakeJit(PARAMS))
    assert not launcher.enabled and launcher.disabled_reason == "Triton interpreter"


def test_pointer_alignment_is_part_of_the_specialization(fake_cuda: list[int]) -> None:
    """A pointer that is not 16-byte aligned (an int64 view at an odd offset) is another
    specialization for the JIT: launched through it once, then fast."""
    fn, launcher = make()
    base = torch.zeros(64, dtype=torch.int64)
    aligned, odd = base[2:], base[1:]
    for x in (aligned, aligned, odd, odd, aligned):
        launcher.launch((1, 1, 1), "k", (x, 1), {"BLOCK": 16, "FLAG": False})
    assert [call[1][0].data_ptr() for call in fn.jit_calls] == [aligned.data_ptr(),
                                                                 odd.data_ptr()]
    assert launcher.fast_launches == 3


def test_exempt_pointers_do_not_specialize_on_alignment(fake_cuda: list[int]) -> None:
    fn, launcher = make(do_not_specialize=("x_ptr",))
    base = torch.zeros(64, dtype=torch.int64)
    for x in (base[2:], base[1:], base[3:]):
        launcher.launch((1, 1, 1), "k", (x, 1), {"BLOCK": 16, "FLAG": False})
    assert len(fn.jit_calls) == 1 and launcher.fast_launches == 2


@pytest.mark.parametrize("n", [0, 1, 2, 3, 63, 64, 65, 1000, 4096])
def test_integer_helpers_match_their_definitions(n: int) -> None:
    assert cdiv(n, 64) == -(-n // 64) == (n + 63) // 64
    p = next_power_of_2(n)
    assert p >= max(n, 1) and p & (p - 1) == 0 and (p == 1 or p // 2 < n)


class PerOptionJit(FakeJit):
    """A JIT stand-in that compiles one kernel per ``launch_pdl`` option, as Triton does
    (launch options are part of its cache key)."""

    def __init__(self, params: list[Param]) -> None:
        super().__init__(params)
        self.by_pdl: dict[bool, FakeCompiled] = {}

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def call(*args: Any, **kwargs: Any) -> FakeCompiled:
            self.jit_calls.append((grid, args, kwargs))
            return self.by_pdl.setdefault(kwargs.get("launch_pdl", False), FakeCompiled())
        return call


def test_a_pdl_kernel_gets_the_switch_as_constexpr_and_launch_option_and_keys_on_it(
        fake_cuda: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    from executor.kernels.switches import KernelSwitches

    fn = PerOptionJit([*PARAMS, Param("USE_PDL", True)])
    launcher = FastLauncher(fn, pdl=True, num_warps=4)
    launcher.enabled, launcher.disabled_reason = True, ""
    x = torch.zeros(4)
    for _ in range(2):
        launcher.launch((1, 1, 1), "k", (x, 1), {"BLOCK": 16, "FLAG": False})
    # Off: no launch_pdl option at all (the interpreter and older Triton reject it).
    assert fn.jit_calls[0][2] == {"BLOCK": 16, "FLAG": False, "USE_PDL": False, "num_warps": 4}
    assert fn.by_pdl[False].runs[-1][-3:] == (16, False, False)

    with KernelSwitches(pdl=True):
        for _ in range(2):
            launcher.launch((1, 1, 1), "k", (x, 1), {"BLOCK": 16, "FLAG": False})
    assert len(fn.jit_calls) == 2, "switching PDL on is a new specialization"
    assert fn.jit_calls[1][2] == {"BLOCK": 16, "FLAG": False, "USE_PDL": True,
                                  "num_warps": 4, "launch_pdl": True}
    assert fn.by_pdl[True].runs[-1][-3:] == (16, False, True)

    launcher.launch((1, 1, 1), "k", (x, 1), {"BLOCK": 16, "FLAG": False})
    assert len(fn.jit_calls) == 2 and len(fn.by_pdl[False].runs) == 2
    assert launcher.fast_launches == 3


def test_pdl_resolves_on_only_where_supported() -> None:
    from executor.kernels import pdl
    from executor.kernels.switches import KernelSwitches, pdl_unsupported_reason

    cpu, cuda = torch.device("cpu"), torch.device("cuda:0")
    assert pdl_unsupported_reason("cpu") == "device cpu is not CUDA"
    off_cuda = KernelSwitches(False, False, moe_one_launch=False)
    assert KernelSwitches.resolve("auto", "auto", cpu) == off_cuda
    assert not pdl.enabled() and pdl.options() == {"USE_PDL": False}
    with pytest.raises(ConfigError, match=r"--pdl on: .*not available: device cpu is not CUDA"):
        KernelSwitches.resolve("on", "auto", cpu)
    with pytest.raises(ConfigError, match="--skinny-row-kernel on needs a CUDA device"):
        KernelSwitches.resolve("off", "on", cpu)
    # off asks nothing of the device (no CUDA here)
    assert KernelSwitches.resolve("off", "off", cuda, "auto", "off") == off_cuda
    # the FP8 gated epilogue: on unless off (it acts where the loader kept FP8 weights)
    assert KernelSwitches.resolve("off", "off", cpu, "on").fp8_glu
    assert not KernelSwitches.resolve("off", "off", cuda, "off").fp8_glu
    # the one-launch MoE decode: on CUDA devices unless off; on refused elsewhere
    assert KernelSwitches.resolve("off", "off", cuda).moe_one_launch
    assert not KernelSwitches.resolve("off", "off", cuda, "auto", "off").moe_one_launch
    with pytest.raises(ConfigError, match="--moe-one-launch on needs a CUDA device, not cpu"):
        KernelSwitches.resolve("off", "off", cpu, "auto", "on")
    with KernelSwitches(pdl=True):  # only holding switches sets them
        assert pdl.enabled() and pdl.options()["USE_PDL"]
        with KernelSwitches(pdl=True):  # re-entry with equal switches
            assert pdl.enabled()
        with pytest.raises(RuntimeError, match="cannot nest"):
            KernelSwitches(pdl=False).__enter__()
    assert not pdl.enabled()
