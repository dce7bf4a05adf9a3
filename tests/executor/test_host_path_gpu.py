"""The host-path shortcuts on a GPU: fast kernel launches and staged batch transfers give
what the plain paths give.

* ``FastLauncher``: extend attention and the split argmax launched straight to the
  compiled kernel (after the first launch of a specialization) write what the JIT launch
  writes, for batches whose metadata sits at any offset of the packed transfer.
* ``PinnedStaging``: a batch built through the reused pinned buffer equals one built with
  a pinned tensor of its own, and a batch built earlier is not overwritten by later ones.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from executor.attention.triton_kernels import extend as extend_mod  # noqa: E402
from executor.forward_batch import ForwardBatch, PinnedStaging  # noqa: E402
from executor.kernels import argmax as argmax_mod  # noqa: E402
from executor.kv.manager import Allocation, Extension  # noqa: E402

DEVICE = torch.device("cuda")
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
WIDTH = 512  # request-slot table row length


def _extend_case(seed: int, new_lens: list[int], prefix_lens: list[int]
                 ) -> tuple[dict[str, torch.Tensor], int]:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    t = sum(new_lens)
    qkv = torch.randn(t, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=DEVICE, generator=gen)
    qkv = qkv.to(torch.bfloat16)
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=1)
    locations = 4096
    pool_k = torch.randn(locations, KV_HEADS, HEAD_DIM, device=DEVICE, generator=gen)
    table = torch.randint(1, locations - t - 1, (8, WIDTH), device=DEVICE, generator=gen,
                          dtype=torch.int32)
    b = len(new_lens)
    starts = [sum(new_lens[:i]) for i in range(b)]
    # Metadata as views at odd offsets of one packed tensor, as ForwardBatch packs it.
    flat = torch.tensor([0, *range(b), *prefix_lens, *new_lens, *starts], device=DEVICE)
    return {
        "q": q.reshape(t, HEADS, HEAD_DIM), "k": k.reshape(t, KV_HEADS, HEAD_DIM),
        "v": v.reshape(t, KV_HEADS, HEAD_DIM),
        "k_pool": pool_k.to(torch.bfloat16), "v_pool": (pool_k * 0.5).to(torch.bfloat16),
        "table": table, "req": flat[1 : 1 + b], "prefix": flat[1 + b : 1 + 2 * b],
        "lens": flat[1 + 2 * b : 1 + 3 * b], "starts": flat[1 + 3 * b : 1 + 4 * b],
        "loc": torch.arange(locations - t, locations, device=DEVICE),
    }, max(new_lens)


def _run_extend(case: dict[str, torch.Tensor], max_len: int) -> tuple[torch.Tensor, ...]:
    k_pool, v_pool = case["k_pool"].clone(), case["v_pool"].clone()
    out = torch.full_like(case["q"], float("nan"))
    extend_mod.extend_attention(case["q"], case["k"], case["v"], out, k_pool, v_pool,
                                case["table"], case["req"], case["prefix"], case["lens"],
                                case["starts"], max_len, HEAD_DIM**-0.5,
                                out_cache_loc=case["loc"])
    return out, k_pool, v_pool


@pytest.mark.parametrize(("new_lens", "prefix_lens"), [
    ([128], [0]), ([40, 88], [30, 300]), ([1, 7, 64], [5, 0, 200]),
])
def test_extend_fast_launch_equals_jit_launch(new_lens: list[int], prefix_lens: list[int]
                                              ) -> None:
    launcher = extend_mod._LAUNCHER
    case, max_len = _extend_case(len(new_lens), new_lens, prefix_lens)
    launcher.enabled = False
    try:
        expect = _run_extend(case, max_len)
    finally:
        launcher.enabled = True
    _run_extend(case, max_len)  # binds this specialization (through the JIT)
    before = launcher.fast_launches
    got = _run_extend(case, max_len)
    assert launcher.fast_launches == before + 1, launcher.disabled_reason
    for g, e in zip(got, expect, strict=True):
        assert torch.equal(g, e)
    assert not got[0].isnan().any()


def test_argmax_fast_launch_equals_torch() -> None:
    x = torch.randn(3, 128256, device=DEVICE)
    argmax_mod.argmax_rows(x)  # binds the specialization
    before = argmax_mod._CHUNK.fast_launches
    for seed in range(3):
        x = torch.randn(3, 128256, device=DEVICE, generator=torch.Generator(
            device=DEVICE).manual_seed(seed))
        assert torch.equal(argmax_mod.argmax_rows(x), x.argmax(dim=-1))
    assert argmax_mod._CHUNK.fast_launches == before + 3, argmax_mod._CHUNK.disabled_reason


def _alloc(seed: int, new_lens: list[int], prefix_lens: list[int]) -> Allocation:
    exts = tuple(Extension(f"s{i}", i + 1, p, n, p == 0)
                 for i, (n, p) in enumerate(zip(new_lens, prefix_lens, strict=True)))
    total = sum(new_lens)
    locs = torch.randperm(10_000, generator=torch.Generator().manual_seed(seed))[:total] + 1
    return Allocation(exts, locs)


FIELDS = ("input_ids", "positions", "out_cache_loc", "slots", "seq_lens",
          "prefix_lens", "extend_lens", "extend_start", "logits_indices", "table_index")


@pytest.mark.parametrize("long_prompt", [False, True], ids=["list-path", "tensor-path"])
def test_staged_batches_equal_plain_ones_and_stay_intact(long_prompt: bool) -> None:
    staging = PinnedStaging(DEVICE, capacity=64)  # small: the larger batches grow it
    scale = 200 if long_prompt else 3
    cases = [([5 * scale, 2], [0, 9]), ([1, 1, 1], [4, 8, 15]), ([7 * scale], [100])]
    built = []
    for seed, (new_lens, prefix_lens) in enumerate(cases):
        alloc = _alloc(seed, new_lens, prefix_lens)
        tokens = torch.randint(0, 1000, (alloc.num_tokens,)).tolist()
        phase = "decode" if all(n == 1 for n in new_lens) else "prefill"
        args = (phase, tokens, alloc, list(range(len(new_lens))), DEVICE, WIDTH)
        built.append((ForwardBatch.build(*args, staging=staging),  # type: ignore[arg-type]
                      ForwardBatch.build(*args)))  # type: ignore[arg-type]
    torch.cuda.synchronize()
    for staged, plain in built:  # every earlier batch still holds its own values
        for name in FIELDS:
            assert torch.equal(getattr(staged, name), getattr(plain, name)), name
        assert (staged.decode_rows is None) == (plain.decode_rows is None)
        if staged.decode_rows is not None and plain.decode_rows is not None:
            assert torch.equal(staged.decode_rows, plain.decode_rows)
            assert staged.decode_rows.tolist() == [
                plain.out_cache_loc.tolist(), plain.slots.tolist(),
                plain.seq_lens.tolist()]
