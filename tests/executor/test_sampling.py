"""Sampling: greedy, reproducible seeds, filters, and logprobs against a reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor.api import SamplingParams
from executor.sampling import Sampler, apply_filters, exponential_noise

V = 64


def logits(b: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax() -> None:
    x = logits(5)
    out = Sampler()(x, [SamplingParams()] * 5, [1] * 5)
    assert out.token_ids == x.argmax(-1).tolist()


def test_fixed_seed_reproduces_tokens_whatever_the_batch() -> None:
    x = logits(4)
    p = SamplingParams(temperature=1.0, seed=42)
    a = Sampler()(x, [p] * 4, [7, 8, 9, 10])
    b = Sampler()(x, [p] * 4, [7, 8, 9, 10])
    assert a.token_ids == b.token_ids
    # Row 2 alone, in another batch composition, draws the same token.
    c = Sampler()(x[2:3], [p], [9])
    assert c.token_ids[0] == a.token_ids[2]
    # Other seeds or positions change the draws (over many rows some must differ).
    many = logits(64, seed=1)
    d1 = Sampler()(many, [p] * 64, [3] * 64).token_ids
    d2 = Sampler()(many, [SamplingParams(temperature=1.0, seed=43)] * 64, [3] * 64).token_ids
    assert d1 != d2


def test_unseeded_rows_differ_between_calls() -> None:
    many = logits(64, seed=2) * 0.1  # flat: draws vary a lot
    p = SamplingParams(temperature=1.0)
    s = Sampler()
    assert s(many, [p] * 64, [1] * 64).token_ids != s(many, [p] * 64, [1] * 64).token_ids


@pytest.mark.parametrize("params,allowed", [
    (SamplingParams(temperature=1.0, top_k=3),
     lambda x: set(torch.topk(x, 3).indices.tolist())),
    (SamplingParams(temperature=0.7, top_p=0.5), None),
    (SamplingParams(temperature=1.5, min_p=0.2),
     lambda x: set(torch.nonzero(x.softmax(-1) >= 0.2 * x.softmax(-1).max() - 1e-9)
                   .flatten().tolist())),
])
def test_filters_never_return_a_token_outside_the_allowed_set(params: SamplingParams,
                                                              allowed: object) -> None:
    x = logits(1, seed=3)[0]
    if allowed is None:  # top-p: smallest prefix of sorted probs reaching p
        probs = (x / params.temperature).softmax(-1)
        order = probs.argsort(descending=True)
        cum = probs[order].cumsum(0)
        keep = int((cum < params.top_p).sum()) + 1
        allowed_set = set(order[:keep].tolist())
    else:
        allowed_set = allowed(x / params.temperature)  # type: ignore[operator]
    s = Sampler()
    drawn = {s(x[None], [params], [i]).token_ids[0] for i in range(300)}
    assert drawn <= allowed_set
    assert len(drawn) > 1  # it really samples


def test_filters_mix_per_row_parameters() -> None:
    x = logits(3, seed=4)
    params = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, top_p=1e-6)]
    f = apply_filters(x, params)
    assert torch.isfinite(f[0]).sum() == 1 and torch.isfinite(f[1]).all()
    assert torch.isfinite(f[2]).sum() == 1
    assert int(f[2].argmax()) == int(x[2].argmax())


def test_sampling_frequencies_follow_the_distribution() -> None:
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    n = 4000
    counts = torch.zeros(4)
    s = Sampler(seed=0)
    tokens = s(x.expand(n, 4).contiguous(), [SamplingParams(temperature=1.0)] * n,
               list(range(n))).token_ids
    for t in tokens:
        counts[t] += 1
    torch.testing.assert_close(counts / n, x.softmax(-1)[0], atol=0.03, rtol=0)


def test_logprobs_match_reference_softmax() -> None:
    x = logits(3, seed=5)
    params = [SamplingParams(temperature=0.8, seed=1, logprobs=True, top_logprobs=5)] * 3
    out = Sampler()(x, params, [0, 1, 2])
    ref = torch.log_softmax(x.double(), -1)
    for i in range(3):
        assert out.logprobs[i] == pytest.approx(float(ref[i, out.token_ids[i]]), abs=1e-5)
        top = out.top_logprobs[i]
        assert [t for t, _ in top] == ref[i].topk(5).indices.tolist()
        for t, lp in top:
            assert lp == pytest.approx(float(ref[i, t]), abs=1e-5)
        assert out.logprobs[i] <= top[0][1] + 1e-6  # nothing beats the top token


def test_exponential_noise_is_deterministic_and_exp1() -> None:
    keys = torch.tensor([1, 2, 3])
    a, b = exponential_noise(keys, 5000), exponential_noise(keys, 5000)
    assert torch.equal(a, b) and (a > 0).all()
    assert float(a.mean()) == pytest.approx(1.0, abs=0.05)


# -- extreme parameters (issue 19, defect 5) -----------------------------------------------
# float32 logits divided by a temperature under ~3e-38 overflowed to inf; the softmax made
# NaN of them and the draw returned token 0 (logprob -13.6) instead of the top token.
TINY_TEMPERATURES = (1e-45, 3e-39, 1e-38, 3e-38, 1e-30, 1e-8, 9.99e-6)


@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
def test_tiny_temperature_is_greedy(temperature: float) -> None:
    x = logits(8, seed=5) + 20.0  # token 0 is rarely the top one
    params = [SamplingParams(temperature=temperature, top_k=5, seed=1, logprobs=True)] * 8
    out = Sampler()(x, params, list(range(8)))
    assert out.token_ids == x.argmax(-1).tolist()
    assert SamplingParams(temperature=temperature).is_greedy


_finite_logits = st.lists(st.floats(-60.0, 60.0, width=32), min_size=V, max_size=V)
_extreme = st.builds(
    SamplingParams,
    temperature=st.one_of(st.sampled_from((0.0, *TINY_TEMPERATURES, 1e-5, 1e30, 3.4e38)),
                          st.floats(0.0, 1e6)),
    top_k=st.sampled_from((0, 1, 2, V, V + 7)),
    top_p=st.one_of(st.just(1.0), st.sampled_from((1e-45, 1e-30, 1e-7)),
                    st.floats(1e-6, 1.0)),
    min_p=st.one_of(st.just(0.0), st.sampled_from((1.0, 1.0 - 1e-7, 0.999999)),
                    st.floats(0.0, 1.0)),
    seed=st.integers(0, 2**64 - 1), logprobs=st.just(True),
    top_logprobs=st.integers(0, 20))


@settings(max_examples=150, deadline=None)
@given(rows=st.lists(st.tuples(_finite_logits, _extreme), min_size=1, max_size=4))
def test_extreme_parameters_give_an_allowed_token(
        rows: list[tuple[list[float], SamplingParams]]) -> None:
    """Whatever the parameters: a token in range with a finite logprob; top_k 1, top_p near
    0, min_p 1 and greedy temperatures give a token of maximal logit; a sampled token is
    never one the filters removed."""
    x = torch.tensor([r[0] for r in rows], dtype=torch.float32)
    params = [r[1] for r in rows]
    out = Sampler()(x, params, list(range(len(rows))))
    filtered = apply_filters(x, params)
    for i, p in enumerate(params):
        token = out.token_ids[i]
        assert 0 <= token < V
        assert torch.isfinite(torch.tensor(out.logprobs[i]))
        top = float(x[i].max())
        if p.is_greedy or p.top_k == 1 or p.top_p <= 1e-7 or p.min_p == 1.0:
            assert float(x[i, token]) == top, (p, token)
        else:
            assert torch.isfinite(filtered[i, token]), (p, token)
        assert not torch.isnan(filtered[i]).any()


def test_pinned_pool_reuses_buffers_by_shape_and_dtype_and_keeps_a_bounded_number() -> None:
    from executor.sampling import PinnedPool

    pool = PinnedPool(keep=2, pin_memory=False)  # no CUDA here: plain host buffers
    like = torch.zeros(4, dtype=torch.int64)
    a, b = pool.take(like), pool.take(like)
    assert a.shape == (4,) and a.dtype == torch.int64 and a.data_ptr() != b.data_ptr()
    pool.give(a)
    assert pool.take(like) is a  # back from the pool, not made anew
    assert pool.take(torch.zeros(4, dtype=torch.float32)).dtype == torch.float32
    assert pool.take(torch.zeros(5, dtype=torch.int64)).shape == (5,)
    assert pool.allocated == 4
    c = pool.take(like)
    assert pool.allocated == 5
    for buf in (a, b, c):  # a third buffer of one kind is not kept
        pool.give(buf)
    again = [pool.take(like) for _ in range(3)]
    assert again[0] is b and again[1] is a  # the kept two, last given first
    assert again[2] is not c and pool.allocated == 6  # the third was made anew


def test_a_staged_sample_gives_its_buffers_back_once() -> None:
    from executor.sampling import DeviceSample, PinnedPool

    pool = PinnedPool(pin_memory=False)
    given: list[torch.Tensor] = []
    pool.give = given.append  # type: ignore[method-assign]
    sample = DeviceSample(torch.tensor([3, 4]), torch.tensor([-0.5, -1.0]))
    sample._pool = pool  # what stage() sets on CUDA
    sample.release()
    sample.release()
    assert [t.tolist() for t in given] == [[3, 4], [-0.5, -1.0]]


# -- logits in the activation dtype -----------------------------------------------------
# compute_logits returns the LM head's bf16/fp16 output (no float32 cast in the decode
# step); the sampler widens only what it computes in float32, exactly, so a step samples
# as it did from the same logits cast to float32 first.
_MIXED = [
    SamplingParams(),  # greedy
    SamplingParams(temperature=0.8, top_k=20, seed=3),
    SamplingParams(temperature=1.3, top_p=0.9, seed=4, logprobs=True, top_logprobs=3),
    SamplingParams(temperature=1.0, min_p=0.05, seed=5, top_logprobs=5),
    SamplingParams(temperature=0.7),  # unseeded: the host RNG of equally seeded samplers
    SamplingParams(logprobs=True),  # greedy with its logprob
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("targets", [None, [5, -1, 0, 999, -1, 17]])
def test_half_precision_logits_sample_exactly_as_their_float32_cast(
        dtype: torch.dtype, targets: list[int] | None) -> None:
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(len(_MIXED), 1000, generator=gen) * 4).to(dtype)  # (B, V)
    x[0, 123] = x[0, 456] = float(x[0].max()) + 4.0  # a tie: both take its first index
    got = Sampler(seed=0).sample(x, _MIXED, list(range(6)), targets)
    want = Sampler(seed=0).sample(x.float(), _MIXED, list(range(6)), targets)
    for name in ("tokens", "logprobs", "top_ids", "top_values", "target_logprobs"):
        g, w = getattr(got, name), getattr(want, name)
        assert (g is None) == (w is None), name
        if w is not None:  # bit-identical, dtypes included (float32 log-probabilities)
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True, msg=name)
    assert (targets is None) == (got.target_logprobs is None)
    assert got.top_ids is not None and got.top_ids.shape == (6, 5)
    assert int(got.tokens[0]) == 123
    # the greedy rows are the argmax of the bf16/fp16 logits themselves
    assert got.tokens[[0, 5]].tolist() == x[[0, 5]].argmax(-1).tolist()


@pytest.mark.parametrize("mixed", [False, True])
def test_remember_writes_each_rows_token_at_its_slot(mixed: bool) -> None:
    """``remember=(table, slots)``: the sampled tokens land in the table at the rows'
    slots (greedy-only steps through the argmax's own store, mixed steps after the draw),
    the other entries untouched, and the tokens are those of a call without it."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=gen)
    params = [SamplingParams(), SamplingParams(temperature=0.8, seed=7) if mixed
              else SamplingParams(), SamplingParams(), SamplingParams()]
    positions = [3, 4, 5, 6]
    table = torch.full((9,), -1, dtype=torch.int64)
    slots = torch.tensor([7, 2, 5, 0])
    got = Sampler(seed=0).sample(logits, params, positions, remember=(table, slots)).tokens
    plain = Sampler(seed=0).sample(logits, params, positions).tokens
    assert torch.equal(got, plain)
    expect = torch.full((9,), -1, dtype=torch.int64)
    expect[slots] = plain
    assert torch.equal(table, expect)


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("logprobs", [False, True])
def test_given_greedy_tokens_sample_as_the_samplers_own_argmax(mixed: bool,
                                                               logprobs: bool) -> None:
    """``greedy`` (a decode graph's argmax of the rows, computed in the replay) stands for
    the sampler's argmax: the same tokens, log-probabilities and last-token table as
    without it, drawn rows still drawn; the given tensor itself is left as it was (a
    graph's buffer)."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 50, generator=gen)
    drawn = SamplingParams(temperature=0.8, seed=7, logprobs=logprobs)
    plain = SamplingParams(logprobs=logprobs)
    params = [plain, drawn if mixed else plain, plain, plain]
    positions = [3, 4, 5, 6]
    slots = torch.tensor([7, 2, 5, 0])
    given_tokens = logits.argmax(-1)
    kept = given_tokens.clone()
    tables = [torch.full((9,), -1, dtype=torch.int64) for _ in range(2)]
    own = Sampler(seed=0).sample(logits, params, positions, remember=(tables[0], slots))
    got = Sampler(seed=0).sample(logits, params, positions, remember=(tables[1], slots),
                                 greedy=given_tokens)
    assert torch.equal(got.tokens, own.tokens) and torch.equal(tables[1], tables[0])
    assert (got.logprobs is None) == (own.logprobs is None) == (not logprobs)
    if logprobs:
        assert torch.equal(got.logprobs, own.logprobs)  # type: ignore[arg-type]
    assert torch.equal(given_tokens, kept)
