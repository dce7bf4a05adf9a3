"""Pure graph decisions: bucket lists, padding, fallback reasons, mode resolution."""

from __future__ import annotations

import itertools

import pytest

from executor.api import FallbackReason
from executor.errors import ConfigError
from executor.graphs.buckets import (
    bucket_for,
    default_decode_buckets,
    default_prefill_buckets,
    normalize_buckets,
)
from executor.graphs.dispatch import GraphKey, RunnerState, decide
from executor.graphs.registry import resolve_graph_mode


def test_default_decode_buckets() -> None:
    assert default_decode_buckets(1) == (1,)
    assert default_decode_buckets(8) == (1, 2, 4, 8)
    assert default_decode_buckets(30) == (1, 2, 4, 8, 16, 24, 30)
    b = default_decode_buckets(256)
    assert b[:5] == (1, 2, 4, 8, 16) and b[-1] == 256 and len(b) == 3 + 32


def test_default_prefill_buckets() -> None:
    b = default_prefill_buckets(8192)
    assert b[:8] == (4, 8, 12, 16, 20, 24, 28, 32)
    assert b[8:10] == (48, 64) and 256 in b and 288 in b and 576 in b and 1280 in b
    assert b[-1] == 4096 and all(x < y for x, y in itertools.pairwise(b))
    assert default_prefill_buckets(1000)[-2:] == (960, 1000)
    assert default_prefill_buckets(1024)[-1] == 1024


@pytest.mark.parametrize("size,bucket", [(1, 1), (3, 4), (8, 8), (9, 16), (30, 30), (31, None)])
def test_bucket_for_pads_to_next(size: int, bucket: int | None) -> None:
    assert bucket_for(size, default_decode_buckets(30)) == bucket


def test_normalize_buckets() -> None:
    assert normalize_buckets([8, 1, 8, 4]) == (1, 4, 8)
    with pytest.raises(ValueError):
        normalize_buckets([0, 2])


BUCKETS = (1, 2, 4, 8, 256, 1024)


def state(**kw: object) -> RunnerState:
    base: dict[str, object] = dict(cuda=True, enabled=True, buckets=BUCKETS,
                                   captured=frozenset(BUCKETS), failed=frozenset())
    base.update(kw)
    return RunnerState(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("size,st,bucket,reason", [
    (3, state(), 4, None),
    (3, state(cuda=False), None, FallbackReason.NO_CUDA),
    (3, state(enabled=False), None, FallbackReason.DISABLED),
    (2000, state(), None, FallbackReason.TOO_LARGE),
    (300, state(), None, FallbackReason.PADDING),  # bucket 1024 is > 2 x 300 tokens
    (3, state(captured=frozenset({1, 2})), None, FallbackReason.NOT_CAPTURED),
    (3, state(failed=frozenset({4}), captured=frozenset({1, 2})), None,
     FallbackReason.CAPTURE_FAILED),
    (200, state(), 256, None),  # 1.28x padding on a large bucket is fine
    (100, state(), None, FallbackReason.PADDING),  # 256 > 2 * 100
    (9, state(), None, FallbackReason.PADDING),  # bucket 256 is large and > 2 x 9
    (9, state(buckets=(1, 2, 4, 8, 16), captured=frozenset({16})), 16, None),  # small: pad
])
def test_decide(size: int, st: RunnerState, bucket: int | None,
                reason: FallbackReason | None) -> None:
    d = decide(GraphKey("decode", size), st)
    assert (d.bucket, d.reason) == (bucket, reason)
    assert d.use_graph == (bucket is not None)


MODE_TABLE = [
    # phase, requested, cuda -> resolved or error fragment
    ("decode", "auto", True, "full"),
    ("decode", "auto", False, "disabled"),
    ("prefill", "auto", True, "breakable"),
    ("prefill", "auto", False, "disabled"),
    ("decode", "breakable", True, "breakable"),
    ("prefill", "tc_piecewise", True, "tc_piecewise"),
    ("prefill", "disabled", False, "disabled"),
    ("prefill", "full", True, "ERR:variable-length"),
    ("prefill", "fixed_grid", True, "fixed_grid"),
    ("prefill", "fixed_grid", False, "ERR:needs a CUDA device"),
    ("decode", "fixed_grid", True, "ERR:fixed_grid is for prefill"),
    ("decode", "tc_piecewise", True, "ERR:valid: auto, full, breakable, disabled"),
    ("decode", "fast", True, "ERR:unknown mode 'fast'"),
    ("decode", "full", False, "ERR:needs a CUDA device"),
    ("prefill", "breakable", False, "ERR:needs a CUDA device"),
]


@pytest.mark.parametrize("phase,requested,cuda,expect", MODE_TABLE)
def test_resolve_graph_mode_table(phase: str, requested: str, cuda: bool, expect: str) -> None:
    if expect.startswith("ERR:"):
        with pytest.raises(ConfigError, match=expect[4:]):
            resolve_graph_mode(phase, requested, cuda)  # type: ignore[arg-type]
    else:
        assert resolve_graph_mode(phase, requested, cuda) == expect  # type: ignore[arg-type]


def test_capture_backends_by_mode_name() -> None:
    import torch

    from executor.config import GraphConfig
    from executor.graphs.registry import make_capture_backend

    cpu = torch.device("cpu")
    graphs = GraphConfig(compiler="inductor")
    made = {m: make_capture_backend(m, cpu, graphs, "k") for m in
            ("full", "breakable", "fixed_grid", "tc_piecewise")}
    assert {m: b.name for m, b in made.items()} == {m: m for m in made}
    assert [b.attention_in_graph for b in made.values()] == [True, False, True, False]
    assert [b.captures_runner_forward for b in made.values()] == [True, True, True, False]
    assert [b.serves_compiled_shapes for b in made.values()] == [False, False, False, True]
    with pytest.raises(ConfigError,
                       match="available: full, breakable, fixed_grid, tc_piecewise"):
        make_capture_backend("turbo", cpu, graphs, "k")
    with pytest.raises(ConfigError, match="compiler must be 'eager' or 'inductor'"):
        GraphConfig(compiler="tvm")  # type: ignore[arg-type]
