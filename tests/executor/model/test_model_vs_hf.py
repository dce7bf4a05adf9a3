"""Our float32 logits and greedy tokens against HF transformers on the same weights."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest
import torch

from executor.api import DecodeItem, PrefillItem
from executor.config import CacheConfig, ExecutorConfig, ModelConfig
from executor.executor import Executor
from tests.helpers.models import ARCHS

ATOL = 2e-4
PROMPTS = [[3, 17, 99, 4, 250, 8, 41], [5, 6], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [77]]


def make_executor(path: Path) -> Executor:
    cfg = ExecutorConfig(model=ModelConfig(source=str(path), dtype="float32"), device="cpu",
                         cache=CacheConfig(kv_tokens=2048, max_sequences=8, max_context=256))
    return Executor(cfg)


def hf_model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                 attn_implementation="eager")
    return model.eval()


@torch.no_grad()
def hf_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens])).logits[0].float()  # (len, vocab)


def extend_logits(ex: Executor, chunks: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """Allocate and run one packed prefill/extend batch; logits of every new token."""
    alloc = ex.kv.allocate([(sid, len(toks)) for sid, toks in chunks.items()])
    batch = ex.build_batch("prefill", [t for toks in chunks.values() for t in toks], alloc, [])
    batch = dataclasses.replace(batch, logits_indices=torch.arange(batch.num_tokens))
    logits = ex.forward_logits(batch)
    out, start = {}, 0
    for sid, toks in chunks.items():
        out[sid] = logits[start : start + len(toks)]
        start += len(toks)
    return out


@pytest.fixture(scope="module", params=ARCHS)
def pair(request: pytest.FixtureRequest, model_dirs: dict[str, Path]
         ) -> tuple[Executor, torch.nn.Module]:
    path = model_dirs[request.param]
    return make_executor(path), hf_model(path)


def test_batched_prefill_matches_hf(pair: tuple[Executor, torch.nn.Module]) -> None:
    ex, hf = pair
    got = extend_logits(ex, {f"p{i}": p for i, p in enumerate(PROMPTS)})
    for i, prompt in enumerate(PROMPTS):
        torch.testing.assert_close(got[f"p{i}"], hf_logits(hf, prompt), atol=ATOL, rtol=1e-4)
    ex.release(list(got))
    ex.kv.check_invariants()


@pytest.mark.parametrize("splits", [(3,), (2, 9)])
def test_chunked_extend_matches_hf(pair: tuple[Executor, torch.nn.Module],
                                   splits: tuple[int, ...]) -> None:
    """The same prompts fed as 2-3 chunks, all sequences extended in one batch per round."""
    ex, hf = pair
    prompts = {f"c{i}": p for i, p in enumerate(PROMPTS) if len(p) > max(splits)}
    bounds = (0, *splits, None)
    for a, b in itertools.pairwise(bounds):
        got = extend_logits(ex, {sid: p[a:b] for sid, p in prompts.items()})
        for sid, p in prompts.items():
            ref = hf_logits(hf, p)[a:b]
            torch.testing.assert_close(got[sid], ref, atol=ATOL, rtol=1e-4)
    ex.release(list(prompts))
    ex.kv.check_invariants()


def test_decode_steps_match_hf(pair: tuple[Executor, torch.nn.Module]) -> None:
    """20 decode steps after a batched prefill: logits of every step against HF."""
    ex, hf = pair
    seqs = {f"d{i}": list(p) for i, p in enumerate(PROMPTS)}
    last = {sid: lg[-1] for sid, lg in extend_logits(ex, seqs).items()}
    for _ in range(20):
        step = {sid: [int(last[sid].argmax())] for sid in seqs}
        for sid, tok in step.items():
            seqs[sid] += tok
        alloc = ex.kv.allocate([(sid, 1) for sid in seqs])
        batch = ex.build_batch("decode", [t[0] for t in step.values()], alloc,
                               list(range(len(seqs))))
        logits = ex.forward_logits(batch)
        for j, sid in enumerate(seqs):
            torch.testing.assert_close(logits[j], hf_logits(hf, seqs[sid])[-1], atol=ATOL,
                                       rtol=1e-4)
            last[sid] = logits[j]
    ex.release(list(seqs))
    ex.kv.check_invariants()


def test_greedy_tokens_equal_hf_generate(pair: tuple[Executor, torch.nn.Module]) -> None:
    """Public prefill/decode API, greedy, against HF generate for each prompt."""
    ex, hf = pair
    n_new = 12
    res = ex.prefill([PrefillItem(f"g{i}", p) for i, p in enumerate(PROMPTS)])
    ours = {o.seq_id: [o.token_id] for o in res.outputs}
    for _ in range(n_new - 1):
        res = ex.decode([DecodeItem(sid, toks[-1]) for sid, toks in ours.items()])
        for o in res.outputs:
            ours[o.seq_id].append(o.token_id)
    for i, p in enumerate(PROMPTS):
        ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                          max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
        assert ours[f"g{i}"] == ref[0, len(p):].tolist()
    assert ex.release(list(ours)).released == len(PROMPTS)
    ex.kv.check_invariants()
    assert ex.kv_stats().free_tokens == ex.kv_stats().total_tokens


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: the LM head is the embedding
@torch.inference_mode()
def test_compute_logits_stay_in_the_activation_dtype(model_dirs: dict[str, Path], arch: str,
                                                     dtype: torch.dtype) -> None:
    """``compute_logits`` returns the LM head's output as is (no float32 cast: the sampler
    widens what it needs); with ``out`` the GEMM writes rows ``:S`` of the buffer, and that
    view comes back with the same values."""
    from executor.model.llama import CausalLM
    from executor.weights.loader import load_model

    model, _ = load_model(model_dirs[arch], dtype, torch.device("cpu"), 128)
    assert isinstance(model, CausalLM) and model.hidden_dtype == dtype
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(5, model.spec.hidden_size, generator=gen).to(dtype)  # (S, hidden)
    want = model.lm_head(hidden)  # (S, vocab)
    got = model.compute_logits(hidden)
    assert got.dtype == dtype and torch.equal(got, want)
    out = torch.full((8, model.spec.vocab_size), float("nan"), dtype=dtype)
    view = model.compute_logits(hidden, out=out)
    assert view.data_ptr() == out.data_ptr() and view.shape == (5, model.spec.vocab_size)
    assert torch.equal(view, want) and torch.equal(out[:5], want)
    assert out[5:].isnan().all()  # rows past S untouched

    # the executor's eager forward hands the sampler these same logits
    cfg = ExecutorConfig(model=ModelConfig(source=str(model_dirs[arch]),
                                           dtype=str(dtype).removeprefix("torch.")),
                         device="cpu", cache=CacheConfig(kv_tokens=256, max_sequences=2,
                                                         max_context=64))
    ex = Executor(cfg)
    logits = extend_logits(ex, {"a": PROMPTS[0]})["a"]
    assert logits.dtype == dtype and logits.shape == (len(PROMPTS[0]), model.spec.vocab_size)
