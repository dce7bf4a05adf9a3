"""``SlotControls``: staging (only what changed; a reused slot goes back to the default),
the torch application against a direct reference, the Triton kernel under the interpreter
against the torch path (odd vocabularies, inactive rows untouched, bias inside and across
chunks), and validation of masks, biases and candidates."""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest
import torch

from executor.api import SamplingParams
from executor.control_validation import control_violations
from executor.logit_controls import (
    SlotControls,
    apply_controls_torch,
    bitmask_allows,
    bitmask_allows_any,
    mask_words,
    unpack_bitmask,
)


def bitmask(ids: list[int], vocab: int) -> bytes:
    bits = np.zeros(mask_words(vocab) * 32, dtype=np.uint8)
    bits[ids] = 1
    return np.packbits(bits, bitorder="little").tobytes()


def reference(logits: torch.Tensor, rows: list[SamplingParams]) -> torch.Tensor:
    out = logits.clone()
    for r, p in enumerate(rows):
        if p.allowed_token_bitmask is not None:
            keep = torch.from_numpy(bitmask_allows(p.allowed_token_bitmask, logits.shape[1]))
            out[r][~keep] = -math.inf
        for tok, b in p.logit_bias:
            out[r, tok] += b
    return out


VOCAB = 2100  # not a multiple of 32, and over two kernel chunks
ROWS = [
    SamplingParams(allowed_token_bitmask=bitmask([0, 5, 31, 32, 1500, VOCAB - 1], VOCAB)),
    SamplingParams(),
    SamplingParams(logit_bias=((0, 3.0), (1023, -2.0), (1024, 1.5), (VOCAB - 1, 100.0))),
    SamplingParams(allowed_token_bitmask=bitmask(list(range(1000, 1100)), VOCAB),
                   logit_bias=((1050, 7.0), (5, 50.0))),
]


def staged(slots: list[int], rows: list[SamplingParams]) -> SlotControls:
    controls = SlotControls(8, VOCAB, torch.device("cpu"))
    assert controls.stage(slots, rows)
    return controls


def test_torch_application_matches_reference() -> None:
    logits = torch.randn(4, VOCAB)
    slots = [3, 0, 6, 1]
    controls = staged(slots, ROWS)
    got = logits.clone()
    controls.apply(got, torch.tensor(slots))
    torch.testing.assert_close(got, reference(logits, ROWS), rtol=0, atol=1e-6)


def test_stage_writes_changes_only_and_resets_reused_slots() -> None:
    controls = staged([3, 0, 6, 1], ROWS)
    assert set(controls._held) == {3, 6, 1}
    # Slot 3's sequence is gone; a plain sequence takes the slot: back to the default.
    assert not controls.stage([3], [SamplingParams()])
    assert 3 not in controls._held
    assert int(controls.active[3]) == 0 and bool((controls.allowed[3] == -1).all())
    assert float(controls.bias_vals[3].abs().sum()) == 0.0
    # Nothing held any more for a plain batch: no work at all.
    fresh = SlotControls(4, VOCAB, torch.device("cpu"))
    assert not fresh.stage([0, 1], [SamplingParams()] * 2)


@pytest.mark.parametrize("vocab", [31, 32, 33, 64, 2100])
def test_allows_any_equals_the_unpacked_mask(vocab: int) -> None:
    words = mask_words(vocab)
    cases = [bitmask([], vocab), bitmask([0], vocab), bitmask([vocab - 1], vocab),
             b"\xff" * 4 * words]
    if vocab % 32:  # only bits past the vocabulary set
        cases.append(bitmask([], vocab)[:-4] + (-1 << (vocab % 32)).to_bytes(4, "little",
                                                                            signed=True))
    rng = np.random.default_rng(vocab)
    cases += [np.packbits((rng.random(words * 32) < q).astype(np.uint8),
                          bitorder="little").tobytes() for q in (0.001, 0.01, 0.5)]
    for mask in cases:
        assert bitmask_allows_any(mask, vocab) == bool(bitmask_allows(mask, vocab).any())


def test_unpack_bitmask_ignores_bits_past_the_vocabulary() -> None:
    words = torch.tensor([[-1] * mask_words(40)], dtype=torch.int32)
    assert unpack_bitmask(words, 40).shape == (1, 40)
    mask = bitmask([39], 40)
    assert bitmask_allows(mask, 40).tolist() == [False] * 39 + [True]


def test_validation_names_the_field() -> None:
    vocab = 100
    bad = SamplingParams(allowed_token_bitmask=b"\x00" * (mask_words(vocab) * 4),
                         logit_bias=((100, 1.0), (3, math.inf)),
                         candidate_token_ids=(1, 100))
    fields = [v.field for v in control_violations(bad, "items[2]", vocab)]
    assert fields == ["items[2].sampling.allowed_token_bitmask",
                      "items[2].sampling.logit_bias[100]", "items[2].sampling.logit_bias[3]",
                      "items[2].candidate_token_ids[1]"]
    # Only bits past the vocabulary set: still no token allowed.
    past = bitmask([], 128)[:-1] + b"\xf0"
    assert control_violations(SamplingParams(allowed_token_bitmask=past[:16]), "i", vocab)
    short = SamplingParams(allowed_token_bitmask=b"\xff" * 3)
    assert "must be 16 bytes" in control_violations(short, "i", vocab)[0].description


def _interpreted_triton() -> bool:
    if torch.cuda.is_available():
        return False
    if "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton
    except ImportError:
        return False
    return type(triton.language.sum).__name__ == "InterpretedFunction"


@pytest.mark.skipif(not _interpreted_triton(),
                    reason="needs Triton's interpreter (TRITON_INTERPRET=1, no CUDA)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_matches_torch_path(dtype: torch.dtype) -> None:
    from executor.kernels.logit_controls import apply_controls

    slots = [3, 0, 6, 1, 5]  # slot 5: never staged (inactive)
    controls = staged(slots[:4], ROWS)
    logits = (torch.randn(5, VOCAB) * 4).to(dtype)
    want = logits.clone()
    apply_controls_torch(want, torch.tensor(slots), controls.active, controls.allowed,
                         controls.bias_ids, controls.bias_vals)
    got = logits.clone()
    apply_controls(got, torch.tensor(slots), controls.active, controls.allowed,
                   controls.bias_ids, controls.bias_vals, block=1024)
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=1e-2)
    assert torch.equal(got[1], logits[1]) and torch.equal(got[4], logits[4])


@pytest.mark.skipif(not _interpreted_triton(),
                    reason="needs Triton's interpreter (TRITON_INTERPRET=1, no CUDA)")
def test_kernel_leaves_rows_of_slots_outside_the_tables_alone() -> None:
    """A graph warmed up before its inputs are written may hand the kernel any slot value:
    a slot outside the tables has no controls, and nothing past the tables is read."""
    from executor.kernels.logit_controls import apply_controls

    controls = staged([0, 1, 2, 3], ROWS)
    n_slots = controls.active.shape[0]
    slots = torch.tensor([0, -7, n_slots, n_slots + 1000])
    logits = torch.randn(4, VOCAB) * 4
    got = logits.clone()
    apply_controls(got, slots, controls.active, controls.allowed, controls.bias_ids,
                   controls.bias_vals, block=1024)
    assert not torch.equal(got[0], logits[0])  # slot 0 is staged: controls applied
    assert torch.equal(got[1:], logits[1:])
