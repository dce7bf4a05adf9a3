"""World size 1 through the distributed code path on CPU (gloo): the same tokens as the
plain executor, and the collectives really run (the GPU twin, with NCCL and graphs, is
``tests/executor/distributed/test_world_of_one_gpu.py``)."""

from __future__ import annotations

import torch

from executor.config import CacheConfig, ExecutorConfig, ModelConfig
from executor.distributed import group
from executor.distributed.all_reduce.auto import all_reduce_choice
from executor.executor import Executor
from executor.model.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from tests.executor.distributed.world import transcript, world_of_one

PROMPTS = [[3, 9, 27, 81, 243, 17, 51], [5, 25, 125, 113, 53], [7] * 12]


def test_world_of_one_gives_the_plain_executors_tokens() -> None:
    cfg = ExecutorConfig(model=ModelConfig(source="tiny"), device="cpu",
                         cache=CacheConfig(kv_tokens=256, max_sequences=4, max_context=128),
                         max_prefill_tokens=256, max_decode_batch=4)
    want = transcript(Executor(cfg), PROMPTS)
    calls: list[str] = []
    with world_of_one(torch.device("cpu")) as tp:
        ex = Executor(cfg, tp)
        assert isinstance(ex.model.embed_tokens, VocabParallelEmbedding)  # type: ignore[attr-defined]
        assert isinstance(ex.model.lm_head, ParallelLMHead)  # type: ignore[attr-defined]
        assert ex.channel is not None and ex.rank_memory_bytes[0] > 0
        assert group.all_reduce_algorithm(tp) == "gloo"  # no symmetric memory on CPU
        # "auto", the default, asked; nothing to time on gloo, so nothing was
        assert all_reduce_choice(tp) == {"algorithm": "gloo", "asked": "auto",
                                         "projections_send": False}
        # what Health reports: the group's algorithm, no projection features on gloo
        assert ex.model_info.tp_all_reduce == "gloo"
        assert not any(f.startswith("tp_") for f in ex.model_info.kernel_features)
        assert Executor(cfg).model_info.tp_all_reduce == ""
        assert group.all_reduce_algorithm(group.TensorParallel.single()) == "none"
        # count the collectives one forward runs: embedding, 2 per layer, the LM head
        original_reduce, original_gather = tp.all_reduce, tp.all_gather
        object.__setattr__(tp, "all_reduce",
                           lambda x: (calls.append("reduce"), original_reduce(x))[1])
        object.__setattr__(tp, "all_gather",
                           lambda x: (calls.append("gather"), original_gather(x))[1])
        try:
            got = transcript(ex, PROMPTS)
        finally:
            object.__delattr__(tp, "all_reduce")
            object.__delattr__(tp, "all_gather")
    assert got == want
    layers = ex.spec.num_layers
    forwards = calls.count("reduce") // (1 + 2 * layers)
    assert calls.count("reduce") == forwards * (1 + 2 * layers)
    assert forwards == 2 + 6 + 4  # two prefill chunks, 6 decode steps, 4 in one call
    assert calls.count("gather") == forwards - 1  # the KV-only chunk computes no logits


def test_lm_head_with_no_rows_runs_no_collective() -> None:
    """A graph-replayed prefill chunk that samples nothing asks the LM head for 0 rows
    (on two H100s this crashed a rank: a 0-row reshape(-1)); every rank has the same row
    count, so every rank skips the all-gather."""
    with world_of_one(torch.device("cpu")) as tp:
        head = ParallelLMHead(10, 4, tp)
        torch.nn.init.normal_(head.weight)
        gathered: list[int] = []
        original = tp.all_gather
        object.__setattr__(tp, "all_gather",
                           lambda x: (gathered.append(x.shape[0]), original(x))[1])
        try:
            assert head(torch.empty(0, 4)).shape == (0, 10) and gathered == []
            hidden = torch.randn(3, 4)
            torch.testing.assert_close(head(hidden), hidden @ head.weight.T)
            assert gathered == [3]
        finally:
            object.__delattr__(tp, "all_gather")


def test_the_in_place_all_reduce_reduces_its_input_and_compiles() -> None:
    """The NCCL/gloo all-reduce sums in place and hands back its input (no copy first);
    traced by torch.compile (as inside tc_piecewise pieces) it gives the eager result."""
    with world_of_one(torch.device("cpu")) as tp:
        x = torch.arange(6, dtype=torch.float32).view(2, 3)
        out = tp.all_reduce(x)
        assert out is x and torch.equal(out, torch.arange(6.0).view(2, 3))  # one rank
        w = torch.randn(3, 4)

        def f(a: torch.Tensor) -> torch.Tensor:
            return tp.all_reduce(a @ w) * 2 + 1

        a = torch.randn(5, 3)
        compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
        assert torch.allclose(compiled(a), f(a))
        strided = torch.randn(4, 6)[:, ::2]  # not contiguous: the out-of-place op
        got = tp.all_reduce(strided)
        assert got is not strided and torch.equal(got, strided)
