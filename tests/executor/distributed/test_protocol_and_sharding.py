"""The pieces of tensor parallelism that need no process group: the step header, the
weight splits, the vocabulary shards and the rendezvous environment."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from executor.distributed.all_reduce import auto
from executor.distributed.all_reduce.paths import PATHS
from executor.distributed.protocol import (
    HEADER_LEN,
    CaptureHeader,
    ForkHeader,
    Mode,
    ShutdownHeader,
    StepHeader,
    decode,
)
from executor.distributed.spawn import ParallelConfig, Rendezvous, describe_exit
from executor.errors import ConfigError, ModelLoadError
from executor.packing import PackedSizes
from executor.weights.loader import load_hf_config
from executor.weights.sharding import (
    VocabShard,
    check_divisible,
    copy_shard,
    local_spec,
    valid_sizes,
)
from executor.weights.tiny import ensure_tiny_model


@given(tokens=st.integers(0, 300), pad=st.integers(0, 64), logits=st.integers(0, 40),
       decode_phase=st.booleans(), bucket=st.one_of(st.none(), st.integers(1, 512)),
       mode=st.sampled_from(list(Mode)), sampled=st.integers(0, 300))
def test_step_header_round_trips(tokens: int, pad: int, logits: int, decode_phase: bool,
                                 bucket: int | None, mode: Mode, sampled: int) -> None:
    seqs = tokens if decode_phase else max(1, tokens // 3)
    sizes = PackedSizes(tokens, pad, seqs, pad if decode_phase else 0, logits, decode_phase)
    header = StepHeader("decode" if decode_phase else "prefill", mode, bucket, sizes, sampled)
    encoded = header.encode()
    assert len(encoded) == HEADER_LEN
    assert decode(encoded) == header


def test_other_headers_round_trip_and_garbage_is_refused() -> None:
    for header in (CaptureHeader(("decode",), True), CaptureHeader(("prefill", "decode"), False),
                   ForkHeader(3, 7, 120, True), ForkHeader(0, 1, 0, False), ShutdownHeader()):
        assert decode(header.encode()) == header
    with pytest.raises(ValueError, match="unknown operation"):
        decode([99] + [0] * (HEADER_LEN - 1))
    bad = StepHeader("prefill", Mode.LOGITS, None, PackedSizes(4, 0, 1, 0, 1), 1).encode()
    bad[-1] += 1  # the total no longer matches the sizes
    with pytest.raises(ValueError, match="add up"):
        decode(bad)
    with pytest.raises(ValueError, match="entries"):
        decode([1, 2])


def test_heads_that_do_not_divide_are_refused_in_one_line() -> None:
    spec = load_hf_config(ensure_tiny_model())  # 4 query heads, 2 KV heads, MLP 256
    assert valid_sizes(spec) == [1, 2]
    with pytest.raises(ConfigError) as err:
        check_divisible(spec, 4)
    message = str(err.value)
    assert "\n" not in message and "2 KV heads" in message and "sizes that work: 1, 2" in message
    half = local_spec(spec, 2)
    assert (half.num_heads, half.num_kv_heads, half.intermediate_size) == (2, 1, 128)
    assert (half.vocab_size, half.hidden_size, half.head_dim) == (512, 128, 32)


@given(vocab=st.integers(1, 1000), size=st.integers(1, 8))
def test_vocab_shards_cover_the_vocabulary_once(vocab: int, size: int) -> None:
    shards = [VocabShard.of(vocab, r, size) for r in range(size)]
    covered = [t for s in shards for t in range(s.start, s.end)]
    assert covered == list(range(vocab))
    assert all(s.end - s.start <= s.rows == shards[0].rows for s in shards)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "q": torch.randn(12, 6, generator=g),  # column-parallel rows
        "o": torch.randn(6, 12, generator=g),  # row-parallel columns
        "embed": torch.randn(10, 6, generator=g),  # vocabulary rows, 10 = not a multiple of 3
        "norm": torch.randn(6, generator=g),  # replicated
    }
    path = tmp_path_factory.mktemp("ckpt") / "w.safetensors"
    save_file(tensors, str(path))
    return path, tensors


NAMES = {"q": "layers.0.self_attn.qkv_proj.weight", "o": "layers.0.self_attn.o_proj.weight",
         "embed": "embed_tokens.weight", "norm": "layers.0.input_layernorm.weight"}


@settings(max_examples=20, deadline=None)
@given(size=st.sampled_from([1, 2, 3]))
def test_rank_slices_reassemble_the_checkpoint(
        checkpoint: tuple[Path, dict[str, torch.Tensor]], size: int) -> None:
    path, full = checkpoint
    with safe_open(str(path), framework="pt", device="cpu") as f:
        for key, name in NAMES.items():
            parts = []
            for rank in range(size):
                shape = list(full[key].shape)
                if key == "q":
                    shape[0] //= size
                elif key == "o":
                    shape[1] //= size
                elif key == "embed":
                    shape[0] = VocabShard.of(10, rank, size).rows
                target = torch.full(shape, float("nan"))
                copy_shard(f, key, name, target, rank, size, path.name)
                parts.append(target)
            if key == "norm":
                assert all(torch.equal(p, full[key]) for p in parts)
                continue
            joined = torch.cat(parts, dim=1 if key == "o" else 0)
            if key == "embed":
                assert torch.equal(joined[:10], full[key]) and not joined[10:].any()
            else:
                assert torch.equal(joined, full[key])


def test_a_slice_of_the_wrong_shape_is_a_load_error(
        checkpoint: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = checkpoint
    with safe_open(str(path), framework="pt", device="cpu") as f, \
            pytest.raises(ModelLoadError, match="split 2 ways"):
        copy_shard(f, "q", NAMES["q"], torch.empty(5, 6), 0, 2, path.name)


def test_rendezvous_from_a_torchrun_environment() -> None:
    assert Rendezvous.from_env({}) is None
    env = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "4", "RANK": "2",
           "LOCAL_RANK": "0"}
    assert Rendezvous.from_env(env) == Rendezvous("10.0.0.1", 29500, 4, 2, 0, False)
    agent = Rendezvous.from_env({**env, "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert agent is not None and agent.agent_store
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        Rendezvous.from_env({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match="not in"):
        Rendezvous.from_env({**env, "RANK": "4"})
    with pytest.raises(ConfigError):
        ParallelConfig(0)
    assert describe_exit(-9) == "was killed by SIGKILL" and describe_exit(3) == "exited with code 3"


KIB = 1024


@pytest.mark.parametrize(("times", "plan"), [
    # one one-shot kernel against NCCL (the H200 and H100 cases measured)
    ({"nccl": (10.7, 12.0, 30.0), "symm_mem": (6.8, 9.0, 25.0)}, [("symm_mem", 512 * KIB)]),
    ({"nccl": (8.1, 9.0, 20.0), "symm_mem": (10.9, 8.0, 15.0)}, []),  # lost at one row: never
    ({"nccl": (10.0, 12.0, 20.0), "symm_mem": (7.0, 11.0, 26.0)}, [("symm_mem", 64 * KIB)]),
    ({"nccl": (10.0, 12.0, 20.0), "symm_mem": (7.0, 12.0, 15.0)}, [("symm_mem", 8 * KIB)]),
    # both: each size to the fastest, in ranges; NCCL from the first size it wins at
    ({"nccl": (12.1, 13.1, 15.5), "symm_mem": (8.0, 8.2, 12.6), "flags": (4.2, 4.5, 13.9)},
     [("flags", 64 * KIB), ("symm_mem", 512 * KIB)]),
    ({"nccl": (12.0, 13.0, 15.0), "symm_mem": (8.0, 8.0, 12.0), "flags": (4.0, 8.5, 11.0)},
     [("flags", 8 * KIB), ("symm_mem", 64 * KIB), ("flags", 512 * KIB)]),
    ({"nccl": (9.0, 9.0, 9.0), "symm_mem": (8.0, 9.5, 8.0), "flags": (9.0, 9.0, 5.0)},
     [("symm_mem", 8 * KIB)]),  # NCCL ties at 64 KiB: it takes that and everything above
])
def test_auto_shares_the_sizes_out_by_the_fastest_at_each_probe(
        times: dict[str, tuple[float, ...]], plan: list[tuple[str, int]]) -> None:
    assert auto.size_plan(auto.AUTO_PROBE_BYTES, times) == plan


@pytest.mark.parametrize("kind", ["flags", "push"])
def test_our_all_reduce_kernels_are_offered_only_to_power_of_two_groups_they_have_room_for(
        kind: str) -> None:
    """The flag kernel's ranks are a tl.arange and its flag area holds ``MAX_WORLD`` ranks
    (the push kernel unrolls a loop over the ranks, held to the same groups): a group of 3
    or of 16 is refused before any device is asked (those fall back to PyTorch's kernel or
    NCCL), whatever the machine."""
    from executor.kernels.all_reduce import MAX_WORLD

    assert MAX_WORLD == 8
    for size in (3, 6, 16):
        assert not PATHS[kind].possible(torch.device("cuda", 0), size)
