"""The server's defaults start on CUDA in float32 (marker ``gpu``): ``auto`` attention
settles on a backend that cannot be captured (the kernels serve fp16/bf16), so ``auto``
decode graphs fall back to ``breakable``; graphs capture, and a prefill and decodes
through them give the eager results."""

from __future__ import annotations

import dataclasses

import pytest

from executor.api import DecodeItem, PrefillItem
from executor.config import CacheConfig
from executor.executor import Executor
from service.cli import build_configs, build_parser

pytestmark = pytest.mark.gpu


def _executor(*flags: str) -> Executor:
    config = build_configs(build_parser().parse_args(
        ["serve", "--device", "cuda", "--dtype", "float32", "--max-sequences", "8", *flags]))[0]
    return Executor(dataclasses.replace(config, cache=CacheConfig(
        kv_tokens=8192, max_sequences=8, max_context=512)))


def _generate(ex: Executor, steps: int) -> list[int]:
    out = ex.prefill([PrefillItem("s", list(range(1, 40)))]).outputs[0]
    tokens = [out.token_id]
    for _ in range(steps):
        out = ex.decode([DecodeItem("s", tokens[-1])]).outputs[0]
        tokens.append(out.token_id)
    assert out.seq_len == 39 + steps
    ex.release(["s"])
    return tokens  # type: ignore[return-value]


def test_cuda_float32_with_every_setting_auto_serves_through_graphs() -> None:
    ex = _executor()  # every attention and graph setting at its default: auto
    assert ex.model_info.attention_backend == "torch_native"
    modes = {g.phase: g.mode for g in ex.status().graphs}
    assert modes == {"decode": "breakable", "prefill": "breakable"}
    captures = ex.capture(ex.startup_phases())
    assert all(b.ok for c in captures for b in c.buckets), captures
    with_graphs = _generate(ex, 6)
    eager = _executor("--decode-graph", "disabled", "--prefill-graph", "disabled")
    assert with_graphs == _generate(eager, 6)  # greedy: graphs replay the eager forward
