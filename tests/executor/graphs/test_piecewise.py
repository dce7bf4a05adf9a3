"""tc_piecewise on CPU: the split at attention, compiled pieces vs eager, the disk cache.

No CUDA graphs here (capture needs CUDA; ``tests/executor/graphs/test_piecewise_gpu.py``): the
compiled forward runs its pieces directly, which is also the runner's eager fallback.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from executor.attention.base import SCOPED, AttentionShape
from executor.attention.torch_native import TorchNativeBackend
from executor.forward_batch import ForwardBatch
from executor.graphs.breakable import BatchScope
from executor.graphs.piecewise import PiecewiseCompileBackend
from executor.graphs.piecewise.custom_op import ATTENTION_BINDING, is_attention
from executor.graphs.piecewise.pieces import GraphMode
from executor.kv import KVCacheManager, KVPool, ReqToTokenTable
from executor.model.llama import CausalLM
from executor.model.spec import ModelSpec
from executor.weights.loader import load_model
from executor.weights.tiny import ensure_tiny_model

CPU = torch.device("cpu")
MAX_CONTEXT = 256
MAX_TOKENS = 64  # the runner's largest bucket: OpAttention's static output rows
Forward = Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]


@dataclass
class Rig:
    model: CausalLM
    spec: ModelSpec
    pool: KVPool
    table: ReqToTokenTable
    kv: KVCacheManager
    attn: TorchNativeBackend

    def batch(self, chunks: dict[str, int], seed: int) -> ForwardBatch:
        """Allocate and pack ``chunks`` (seq_id -> new tokens) with random token ids."""
        alloc = self.kv.allocate(list(chunks.items()))
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, self.spec.vocab_size, (alloc.num_tokens,), generator=gen)
        batch = ForwardBatch.build("prefill", tokens.tolist(), alloc, [], CPU,
                                   self.table.max_context)
        # Publish the new locations to the table attention reads (as Executor.build_batch).
        self.table.write_device(batch.table_index, batch.out_cache_loc)
        return batch


def make_rig(path: Path) -> Rig:
    model, spec = load_model(path, torch.float32, CPU, MAX_CONTEXT)
    pool = KVPool(spec.num_layers, 2048, spec.num_kv_heads, spec.head_dim, torch.float32, CPU)
    table = ReqToTokenTable(16, MAX_CONTEXT, CPU)
    shape = AttentionShape(spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.attn_scale)
    return Rig(model, spec, pool, table, KVCacheManager(table, 2048),
               TorchNativeBackend(shape, pool, table))


def compiled(rig: Rig, compiler: str = "eager", **kwargs: Any
             ) -> tuple[PiecewiseCompileBackend, BatchScope, Forward]:
    """A backend wired as ``GraphRunner`` wires it: wrap attention, then the forward."""
    backend = PiecewiseCompileBackend(CPU, compiler, **kwargs)  # type: ignore[arg-type]
    scope = BatchScope()
    model_attn = backend.wrap_attention(rig.attn, scope, MAX_TOKENS)
    forward = backend.prepare_forward(lambda ids, pos, meta: rig.model(ids, pos, model_attn,
                                                                       meta))
    return backend, scope, forward


@torch.inference_mode()
def run_compiled(rig: Rig, scope: BatchScope, forward: Forward, batch: ForwardBatch,
                 bucket: int) -> torch.Tensor:
    """The batch padded to ``bucket`` (token 0 at position 0), as the runner's static
    buffers hold it; hidden states of all ``bucket`` rows."""
    t = batch.num_tokens
    ids, pos = torch.zeros(bucket, dtype=torch.int64), torch.zeros(bucket, dtype=torch.int64)
    ids[:t], pos[:t] = batch.input_ids, batch.positions
    with scope.bind(rig.attn.build_metadata(batch), t):
        return forward(ids, pos, SCOPED).clone()


@torch.inference_mode()
def run_eager(rig: Rig, batch: ForwardBatch) -> torch.Tensor:
    return rig.model(batch.input_ids, batch.positions, rig.attn, rig.attn.build_metadata(batch))


def stored_kv(rig: Rig, batch: ForwardBatch) -> torch.Tensor:
    loc = batch.out_cache_loc
    return torch.stack([rig.pool.k_buffer[:, loc], rig.pool.v_buffer[:, loc]]).clone()


def clear_kv(rig: Rig, batch: ForwardBatch) -> None:
    rig.pool.k_buffer[:, batch.out_cache_loc] = 0
    rig.pool.v_buffer[:, batch.out_cache_loc] = 0


def check_equal_eager(rig: Rig, scope: BatchScope, forward: Forward, atol: float) -> None:
    """New, padded, multi-sequence and continuing batches: hidden states and the K/V
    stored match eager; padded rows stay finite and store nothing."""
    steps: list[tuple[dict[str, int], int]] = [
        ({"a": 7}, 7),  # exact bucket
        ({"b": 5}, 8),  # padded
        ({"c": 10, "d": 3}, 16),  # two new sequences, padded
        ({"a": 4, "e": 6, "c": 1}, 12),  # continuing a and c with new e, padded
        ({"b": 9, "d": 2}, 11),  # continuing only, exact
    ]
    for seed, (chunks, bucket) in enumerate(steps):
        batch = rig.batch(chunks, seed)
        t = batch.num_tokens
        clear_kv(rig, batch)
        out = run_compiled(rig, scope, forward, batch, bucket)
        kv_compiled = stored_kv(rig, batch)
        clear_kv(rig, batch)
        ref = run_eager(rig, batch)  # leaves eager K/V for the continuing steps
        torch.testing.assert_close(out[:t], ref, atol=atol, rtol=atol)
        assert bool(out.isfinite().all())
        assert kv_compiled.abs().sum() > 0
        torch.testing.assert_close(kv_compiled, stored_kv(rig, batch), atol=atol, rtol=atol)
    assert rig.pool.k_buffer[:, 0].abs().sum() == 0, "a padded row stored K/V"
    rig.kv.check_invariants()


@pytest.fixture(scope="module")
def tiny_path() -> Path:
    return ensure_tiny_model()


@pytest.fixture
def rig(tiny_path: Path) -> Rig:
    return make_rig(tiny_path)


def test_split_puts_every_attention_at_a_split_point(rig: Rig, tmp_path: Path) -> None:
    backend, scope, forward = compiled(rig, debug_dir=tmp_path)
    run_compiled(rig, scope, forward, rig.batch({"s": 9}, 0), 12)
    layers = rig.spec.num_layers
    assert backend.split is not None
    kinds = [s.kind for s in backend.split.submodules]
    # piece, attention, piece, ..., attention, piece: pieces == attention calls + 1
    assert kinds == ["graph", "attention"] * layers + ["graph"]
    assert backend.stats.attention_ops == layers and backend.stats.pieces == layers + 1
    # Every attention submodule is exactly one attention call and nothing else.
    for sub in backend.split.attention:
        gm = backend.split.submodule(sub.name)
        assert isinstance(gm, torch.fx.GraphModule)
        calls = [n for n in gm.graph.nodes if n.op == "call_function"]
        assert len(calls) == 1 and is_attention(calls[0].target)
        # ... which the backend calls directly, past the dispatcher (see direct_call).
        assert backend.split.module.__dict__[sub.name].__name__ == "attention"
    # The debug dump: Dynamo graph, split graph and one file per submodule.
    files = sorted(p.name for p in (tmp_path / "compile_1").iterdir())
    assert "split_graph.py" in files and "dynamo_graph.py" in files
    assert len(files) == 2 + 2 * layers + 1
    assert "torch.ops.model_executor.attention" in (tmp_path / "compile_1" /
                                                    "001_attention_0.py").read_text()


def test_eager_pieces_equal_eager_model(rig: Rig) -> None:
    backend, scope, forward = compiled(rig)
    check_equal_eager(rig, scope, forward, atol=1e-5)
    # One compilation serves every token count (the token dimension is dynamic).
    assert backend.stats.compilations == 1
    assert not backend.stats.cache_hit and backend.stats.cache_dir is None  # eager: no cache


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_every_architecture_splits_and_matches(model_dirs: dict[str, Path], arch: str) -> None:
    """Llama 3 RoPE scaling, qkv bias and tied embeddings, per-head q/k norm: the split
    and the eager pieces hold for each supported architecture."""
    rig = make_rig(model_dirs[arch])
    backend, scope, forward = compiled(rig)
    check_equal_eager(rig, scope, forward, atol=1e-5)
    assert backend.stats.attention_ops == rig.spec.num_layers
    assert backend.stats.pieces == rig.spec.num_layers + 1


def test_binding_is_explicit_and_refuses_nesting(rig: Rig) -> None:
    backend, _, forward = compiled(rig)
    q = torch.zeros(4, rig.spec.num_heads, rig.spec.head_dim)
    kv = torch.zeros(4, rig.spec.num_kv_heads, rig.spec.head_dim)
    with pytest.raises(RuntimeError, match="outside a tc_piecewise forward"):
        torch.ops.model_executor.attention(q, kv, kv, 0)
    assert backend.attn is not None
    with ATTENTION_BINDING.bind(backend.attn):
        with pytest.raises(RuntimeError, match="nested"), ATTENTION_BINDING.bind(backend.attn):
            pass
        with pytest.raises(RuntimeError, match="without a bound batch"):
            torch.ops.model_executor.attention(q, kv, kv, 0)
    with pytest.raises(RuntimeError, match="outside"):  # cleared after the error too
        torch.ops.model_executor.attention(q, kv, kv, 0)
    mode = GraphMode()
    with mode.active("capture", 8), pytest.raises(RuntimeError, match="one at a time"), \
            mode.active("replay", 8):
        pass
    assert mode.kind == "run"
    with pytest.raises(RuntimeError, match="CUDA graphs"):
        backend.capture(8, lambda: forward(torch.zeros(8, dtype=torch.int64),
                                           torch.zeros(8, dtype=torch.int64), SCOPED))


def test_compiler_is_validated() -> None:
    with pytest.raises(ValueError, match="valid: eager, inductor"):
        PiecewiseCompileBackend(CPU, "tvm")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def one_layer_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tiny`` with one decoder layer: two distinct pieces keep Inductor's CPU compile
    (a C++ build per piece) short."""
    from executor.weights.random_weights import write_random_model
    from executor.weights.tiny import tiny_config

    cfg = tiny_config()
    cfg.num_hidden_layers = 1
    return write_random_model(tmp_path_factory.mktemp("m") / "tiny-1layer", cfg, seed=3)


@pytest.mark.slow
def test_inductor_pieces_equal_eager_and_disk_cache(one_layer_path: Path, tmp_path: Path
                                                    ) -> None:
    """Cold compile (cache miss), the same key again (hit), another key (miss)."""
    rig = make_rig(one_layer_path)
    cache = tmp_path / "cache"
    starts = {}
    for label, key in (("cold", "model-a"), ("warm", "model-a"), ("other", "model-b")):
        t0 = time.perf_counter()
        backend, scope, forward = compiled(rig, "inductor", cache_dir=cache, cache_key=key)
        check_equal_eager(rig, scope, forward, atol=1e-4)
        starts[label] = backend.stats
        print(f"{label}: {time.perf_counter() - t0:.1f} s, {backend.stats.as_dict()}")
    cold, warm, other = starts["cold"], starts["warm"], starts["other"]
    assert cold.compilations == warm.compilations == 1
    assert cold.fx_cache_misses > 0 and not cold.cache_hit and cold.artifacts_saved
    assert warm.cache_hit and warm.artifacts_loaded and warm.cache_key == cold.cache_key
    assert warm.compile_s < cold.compile_s
    assert other.cache_key != cold.cache_key
    assert other.fx_cache_misses > 0 and not other.cache_hit and not other.artifacts_loaded
    assert (cache / cold.cache_key / "artifacts.bin").is_file()
