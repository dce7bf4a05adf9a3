"""Helpers shared by the GPU test modules: the test model, graph-vs-eager comparisons,
the tolerances they use."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from executor.api import DecodeItem, Phase, PrefillItem, SamplingParams, StepResult
from executor.config import CacheConfig, ExecutorConfig, GraphConfig, ModelConfig
from executor.executor import Executor
from executor.forward_batch import ForwardBatch
from executor.graphs.graph_runner import GraphRunner
from executor.kv.manager import Allocation

PREFILL_BUCKETS = (4, 8, 16, 32, 64, 128, 256, 512)


def gpu_model(root: Path) -> Path:
    """A small Llama with the 1B's head layout (head_dim 64, GQA 4)."""
    import transformers as tf

    from executor.weights.random_weights import write_random_model

    cfg = tf.LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024,
                         num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-5)
    cfg.architectures = ["LlamaForCausalLM"]
    return write_random_model(root / "gpu-llama", cfg, seed=7)


def make_prefill_executor(path: Path, prefill: str = "breakable", decode: str = "full",
         attention: str = "triton", **overrides: str) -> Executor:
    """An executor of the test model; ``overrides``: other ``ExecutorConfig`` fields."""
    cfg = ExecutorConfig(
        model=ModelConfig(source=str(path), dtype="bfloat16"), device="cuda",
        cache=CacheConfig(kv_tokens=64 * 1024, max_sequences=32, max_context=2048),
        graphs=GraphConfig(decode_mode=decode, prefill_mode=prefill,  # type: ignore[arg-type]
                           decode_buckets=(1, 2, 4, 8, 16), prefill_buckets=PREFILL_BUCKETS),
        attention_backend=attention,  # type: ignore[arg-type]
        max_decode_batch=16, max_prefill_tokens=512)
    return Executor(dataclasses.replace(cfg, **overrides))  # type: ignore[arg-type]


# bf16 logits of magnitude < 16 have an ulp of 1/16: allow two ulps, and compare greedy
# choices only where the top two logits are further apart than that noise.
LOGIT_ATOL, LOGIT_RTOL, MARGIN = 0.125, 0.02, 0.25


def pack_for_bucket(ex: Executor, runner: GraphRunner, phase: Phase, tokens: list[int],
                    alloc: Allocation, rows: list[int], bucket: int) -> ForwardBatch:
    """A batch packed for ``bucket``'s graphs, as the executor packs it for its runners
    (``GraphLayout``): the one way a batch reaches a replay."""
    return ForwardBatch.build(phase, tokens, alloc, rows, ex.device, ex.table.max_context,
                              ex.staging, runner.layout(bucket))


def graph_and_eager(ex: Executor, runner: GraphRunner, phase: Phase, tokens: list[int],
                    alloc: Allocation, bucket: int, all_rows: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of one step through the graphs of ``bucket`` and eagerly.

    The graph step is packed for the bucket, and its captured prologue publishes the table
    entries: checked to write exactly the new tokens' cells (and the scratch cell). The
    eager step reads the same table. ``all_rows``: logits of every token, not only the
    sampled rows."""
    rows = list(range(len(alloc.extensions))) if phase == "decode" else []
    table = ex.table.device_table
    new_cells = torch.zeros(table.shape, dtype=torch.bool, device=table.device)
    for e in alloc.extensions:
        table[e.slot, e.prefix_len : e.seq_len] = -1  # not yet published
        new_cells[e.slot, e.prefix_len : e.seq_len] = True
    before = table.clone()
    staged = pack_for_bucket(ex, runner, phase, tokens, alloc, rows, bucket)
    assert staged.bucket == bucket
    if all_rows:
        staged = dataclasses.replace(
            staged, logits_indices=torch.arange(staged.num_tokens, device=ex.device))
    graph = runner.replay(staged, bucket)[0].clone()
    assert torch.equal(table[~new_cells], before[~new_cells]), "wrote outside the new cells"
    for e in alloc.extensions:
        assert torch.equal(table[e.slot, : e.seq_len], ex.table.host_table[e.slot, : e.seq_len]
                           .to(table.device))
    plain = ex.build_batch(phase, tokens, alloc, rows)
    if all_rows:
        plain = dataclasses.replace(
            plain, logits_indices=torch.arange(plain.num_tokens, device=ex.device))
    eager = ex.forward_logits(plain).clone()
    # Both come from compute_logits, in the activation dtype (the decode graph's shared
    # output buffer too). Compared in float32 as before the logits stayed bf16: the same
    # values (widening is exact), and isclose's allowed error is not rounded to bf16.
    assert graph.dtype == eager.dtype == ex.model.hidden_dtype, (graph.dtype, eager.dtype)
    return graph.float(), eager.float()


def assert_same_greedy(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal argmax wherever the reference's top-2 margin exceeds bf16 noise."""
    top2 = b.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > MARGIN
    assert torch.equal(a.argmax(-1)[clear], b.argmax(-1)[clear])


def rand_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def compare(ex: Executor, chunks: dict[str, list[int]]) -> None:
    """One packed batch through eager and through the graph: logits of every token."""
    alloc = ex.kv.allocate([(s, len(t)) for s, t in chunks.items()])
    tokens = [t for ts in chunks.values() for t in ts]
    decision = ex.forward.decide("prefill", len(tokens))
    assert decision.use_graph and decision.bucket is not None, decision
    graph, eager = graph_and_eager(ex, ex.runners["prefill"], "prefill", tokens, alloc,
                                   decision.bucket, all_rows=True)
    torch.testing.assert_close(graph, eager, atol=LOGIT_ATOL, rtol=LOGIT_RTOL)
    assert_same_greedy(graph, eager)


def greedy_agrees(ex: Executor, eager: Executor) -> None:
    """``ex`` (graphs) and ``eager`` fed the same prompts and tokens agree on every clear
    greedy choice through prefill, a continuing prefill and ten decode steps."""
    params = SamplingParams(logprobs=True, top_logprobs=2)

    def check(g: StepResult, e: StepResult) -> dict[str, int]:
        assert (g.step.path, e.step.path) == ("graph", "eager")
        for og, oe in zip(g.outputs, e.outputs, strict=True):
            (_, lp1), (_, lp2) = oe.top_logprobs
            if lp1 - lp2 > 0.05:
                assert og.token_id == oe.token_id, (og, oe)
        return {o.seq_id: int(o.token_id) for o in g.outputs}  # type: ignore[arg-type]

    first = [PrefillItem(f"q{i}", rand_tokens(10 + 37 * i, i), sampling=params)
             for i in range(5)]
    toks = check(ex.prefill(first), eager.prefill(first))
    more = [PrefillItem("q0", [5, 6, 7], sampling=params), PrefillItem("q3", [8], sampling=params)]
    toks.update(check(ex.prefill(more), eager.prefill(more)))
    for _ in range(10):
        items = [DecodeItem(s, t, params) for s, t in toks.items()]
        toks = check(ex.decode(items), eager.decode(items))
    for e in (ex, eager):
        e.release(list(toks))


def clear_choices_agree(graph: StepResult, eager: StepResult) -> int:
    """How many of a step's tokens the graph and eager runs agree on; asserts agreement
    wherever the eager run's top-2 logprob margin is clear of bf16 noise (the items asked
    for ``top_logprobs`` >= 2)."""
    assert (graph.step.path, eager.step.path) == ("graph", "eager")
    agree = 0
    for og, oe in zip(graph.outputs, eager.outputs, strict=True):
        (_, lp1), (_, lp2) = oe.top_logprobs[:2]
        if lp1 - lp2 > 0.05:
            assert og.token_id == oe.token_id, (og, oe)
        agree += og.token_id == oe.token_id
    return agree
