"""Sliding-window, soft-capped and fused-checkpoint families (Mistral and Qwen2 with a
window, Gemma 2, Gemma 3 text, Phi-3) against HF transformers, in process, float32:
prompts longer than the window (8), chunked, decoded past it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from executor.executor import Executor
from tests.executor.model.test_model_vs_hf import (
    extend_logits,
    hf_logits,
    hf_model,
    make_executor,
)
from tests.helpers.models import WINDOW, WINDOWED_ARCHS, write_model

ATOL = 1e-4
PROMPTS = [[(i * 37) % 250 + 3 for i in range(21)], [5, 6, 7, 200, 9, 10, 11, 12, 13, 14],
           [77, 3]]
assert max(map(len, PROMPTS)) > 2 * WINDOW


@pytest.fixture(scope="module")
def windowed_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("windowed")
    return {kind: write_model(root, kind, seed=10 + i) for i, kind in enumerate(WINDOWED_ARCHS)}


@pytest.fixture(scope="module", params=WINDOWED_ARCHS)
def pair(request: pytest.FixtureRequest, windowed_dirs: dict[str, Path]
         ) -> tuple[Executor, torch.nn.Module]:
    path = windowed_dirs[request.param]
    return make_executor(path), hf_model(path)


def test_chunked_prefill_and_decode_match_hf(pair: tuple[Executor, torch.nn.Module]) -> None:
    """Each prompt in chunks of 6 (the window reaches back into earlier chunks), then 14
    greedy decode steps; every position's logits against HF on the whole sequence."""
    ex, hf = pair
    seqs = {f"w{i}": list(p) for i, p in enumerate(PROMPTS)}
    longest = max(map(len, PROMPTS))
    last: dict[str, torch.Tensor] = {}
    for a in range(0, longest, 6):
        chunk = {sid: p[a : a + 6] for sid, p in seqs.items() if p[a : a + 6]}
        got = extend_logits(ex, chunk)
        for sid, lg in got.items():
            ref = hf_logits(hf, seqs[sid])[a : a + len(chunk[sid])]
            torch.testing.assert_close(lg, ref, atol=ATOL, rtol=1e-4)
            last[sid] = lg[-1]
    for _ in range(14):
        step = {sid: int(last[sid].argmax()) for sid in seqs}
        for sid, tok in step.items():
            seqs[sid].append(tok)
        alloc = ex.kv.allocate([(sid, 1) for sid in seqs])
        batch = ex.build_batch("decode", list(step.values()), alloc, list(range(len(seqs))))
        logits = ex.forward_logits(batch)
        for j, sid in enumerate(seqs):
            torch.testing.assert_close(logits[j], hf_logits(hf, seqs[sid])[-1], atol=ATOL,
                                       rtol=1e-4)
            last[sid] = logits[j]
    ex.release(list(seqs))
    ex.kv.check_invariants()


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])  # final soft-cap, none
@torch.inference_mode()
def test_gemma_compute_logits_into_a_buffer(windowed_dirs: dict[str, Path], kind: str) -> None:
    """``compute_logits`` with ``out`` (the decode graph's buffer): its rows ``:S`` hold
    the same (soft-capped where the config caps) logits, returned as that view."""
    from executor.weights.loader import load_model

    model, spec = load_model(windowed_dirs[kind], torch.float32, torch.device("cpu"), 64)
    hidden = torch.randn(3, spec.hidden_size, generator=torch.Generator().manual_seed(1))
    want = model.compute_logits(hidden)
    if spec.final_softcap:
        assert want.abs().max() < spec.final_softcap
    out = torch.full((5, spec.vocab_size), float("nan"))
    got = model.compute_logits(hidden, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got, want)
    assert out[3:].isnan().all()


@pytest.mark.parametrize("kind", [*WINDOWED_ARCHS, "llama", "qwen3"])
def test_num_params_counts_what_hf_holds(kind: str) -> None:
    """``ModelSpec.num_params`` (the benchmarks' FLOPs floors) equals the parameter count
    of HF's model: Gemma's extra norms, q/k norms and biases included."""
    import transformers as tf

    from executor.model.spec import spec_from_hf_config
    from tests.helpers.models import hf_config

    cfg = hf_config(kind)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    assert spec_from_hf_config(cfg).num_params() == sum(p.numel() for p in model.parameters())
