"""Token masks, logit bias, PROCESSED logprobs, candidates, hidden states and grammars
inside full decode graphs (marker ``gpu``): every step replays a graph (no eager
fallback), the controls hold, the extras match the eager executor's within bf16 noise,
and a slot that had controls serves a plain sequence afterwards exactly as before."""

from __future__ import annotations

import math
from collections import deque
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.common.grammar_vocab import STOP, synthetic_tokenizer_info, use_synthetic_tokenizer
from executor.api import DecodeItem, Grammar, PrefillItem, SamplingParams
from executor.config import CacheConfig, ExecutorConfig, GraphConfig, ModelConfig
from executor.executor import Executor
from executor.steps import PendingStep
from tests.helpers.gpu import gpu_model

pytestmark = pytest.mark.gpu
V = 1024  # gpu_model's vocabulary
B = 8


def make(path: Path, decode_mode: str) -> Executor:
    cfg = ExecutorConfig(
        model=ModelConfig(source=str(path), dtype="bfloat16"), device="cuda",
        cache=CacheConfig(kv_tokens=32 * 1024, max_sequences=32, max_context=1024),
        graphs=GraphConfig(decode_mode=decode_mode, prefill_mode="disabled",  # type: ignore[arg-type]
                           decode_buckets=(1, 2, 4, 8, 16)),
        attention_backend="triton", max_decode_batch=16)
    ex = Executor(cfg)
    if decode_mode != "disabled":
        ex.capture(["decode"])
    use_synthetic_tokenizer(ex)
    return ex


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Executor, Executor]:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path = gpu_model(tmp_path_factory.mktemp("m"))
    return make(path, "full"), make(path, "disabled")


def bitmask(ids: list[int] | range) -> bytes:
    bits = np.zeros(V, dtype=np.uint8)
    bits[list(ids)] = 1
    return np.packbits(bits, bitorder="little").tobytes()


SET = list(range(100, 1024, 7))
ROWS = [
    SamplingParams(allowed_token_bitmask=bitmask([42])),
    SamplingParams(temperature=1.0, seed=1, allowed_token_bitmask=bitmask([42])),
    SamplingParams(temperature=1.0, seed=2, allowed_token_bitmask=bitmask(SET)),
    SamplingParams(temperature=1.0, seed=3, logit_bias=((77, 100.0),)),
    SamplingParams(temperature=0.8, seed=4, top_k=50, logprobs=True, top_logprobs=3,
                   logprobs_mode="processed", allowed_token_bitmask=bitmask(SET),
                   candidate_token_ids=(100, 107, 5), return_hidden_state=True),
    SamplingParams(candidate_token_ids=(1, 2, 3), return_hidden_state=True, logprobs=True),
    SamplingParams(),
    SamplingParams(temperature=1.0, seed=7),
]


def _run(ex: Executor, tag: str, num_steps: int) -> list:
    ids = [f"{tag}{i}" for i in range(B)]
    prompt = [[(i * 31 + k) % V for k in range(20 + i)] for i in range(B)]
    ex.prefill([PrefillItem(s, p, sampling=ROWS[i])
                for i, (s, p) in enumerate(zip(ids, prompt, strict=True))])
    res = ex.decode([DecodeItem(s, None, ROWS[i]) for i, s in enumerate(ids)],
                    num_steps=num_steps)
    assert (res.step.path == "graph") == (ex.runners.get("decode") is not None)
    ex.release(ids)
    return list(res.outputs)


def test_controls_hold_inside_decode_graphs(pair: tuple[Executor, Executor]) -> None:
    graph, eager = pair
    for num_steps in (1, 8):
        out = _run(graph, f"g{num_steps}-", num_steps)
        ref = _run(eager, f"e{num_steps}-", num_steps)
        steps = [o.steps or (o,) for o in out]
        assert all(t.token_id == 42 for t in steps[0]) and all(t.token_id == 42
                                                               for t in steps[1])
        assert all(t.token_id in SET for t in steps[2]) and all(t.token_id in SET
                                                                for t in steps[4])
        assert all(t.token_id == 77 for t in steps[3])
        first, ref_first = (out[4].steps or (out[4],))[0], (ref[4].steps or (ref[4],))[0]
        # Processed: the top-3 of the drawn-from distribution (mask, T 0.8, top-k 50).
        assert len(first.top_logprobs) == 3 and all(t in SET for t, _ in first.top_logprobs)
        assert [v for _, v in first.top_logprobs] == pytest.approx(
            [v for _, v in ref_first.top_logprobs], abs=0.1)
        assert first.candidate_logprobs[2][1] == -math.inf  # token 5 is masked
        assert len(first.hidden_state) == 512
        assert list(first.hidden_state) == pytest.approx(list(ref_first.hidden_state),
                                                         abs=0.1, rel=0.05)


def test_slot_reuse_after_controls_is_plain(pair: tuple[Executor, Executor]) -> None:
    graph, _ = pair
    plain = [SamplingParams()] * B

    def greedy(tag: str) -> list[int]:
        ids = [f"{tag}{i}" for i in range(B)]
        graph.prefill([PrefillItem(s, [5 + i, 9, 13]) for i, s in enumerate(ids)])
        res = graph.decode([DecodeItem(s, None, p) for s, p in zip(ids, plain, strict=True)],
                           num_steps=4)
        graph.release(ids)
        return [t.token_id for o in res.outputs for t in o.steps]

    before = greedy("a")
    _run(graph, "x", 2)  # every slot held controls
    assert greedy("b") == before


def test_grammar_session_depth_2_in_graphs(pair: tuple[Executor, Executor]) -> None:
    """Two steps in flight and num_steps 4, every step a graph replay: each sequence's
    tokens are accepted by a fresh matcher of its grammar."""
    xgr = pytest.importorskip("xgrammar")
    graph, _ = pair
    text = 'root ::= ("{\\"n\\": " [0-9] [0-9]? "}\\n")+'
    params = SamplingParams(temperature=1.0, seed=5, grammar=Grammar("ebnf", text),
                            logit_bias=((STOP, -100.0),))
    ids = [f"gr{i}" for i in range(B)]
    first = graph.prefill([PrefillItem(s, [3 + i, 4], sampling=params)
                           for i, s in enumerate(ids)]).outputs
    out = {o.seq_id: [o.token_id] for o in first}
    items = [DecodeItem(s, None, params) for s in ids]
    inflight: deque[PendingStep] = deque()
    for k in range(12):
        inflight.append(graph.launch_decode(items, num_steps=1 if k % 2 else 4))
        assert inflight[-1].info.path == ("graph" if graph.device.type == "cuda" else "eager")
        if len(inflight) == 2:
            for o in graph.complete(inflight.popleft()).outputs:
                out[o.seq_id] += [t.token_id for t in o.steps] or [o.token_id]
    while inflight:
        for o in graph.complete(inflight.popleft()).outputs:
            out[o.seq_id] += [t.token_id for t in o.steps] or [o.token_id]
    compiler = xgr.GrammarCompiler(synthetic_tokenizer_info(V))
    compiled = compiler.compile_grammar(text)
    for s, toks in out.items():
        matcher = xgr.GrammarMatcher(compiled)
        assert all(matcher.accept_token(t) for t in toks), (s, toks)
    graph.release(ids)
