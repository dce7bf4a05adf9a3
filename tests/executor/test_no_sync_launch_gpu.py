"""Launching a step never waits for the device (marker ``gpu``): under
``torch.cuda.set_sync_debug_mode("error")`` any synchronizing CUDA call (a device-to-host
copy into pageable memory, ``.item()``, a blocking tensor creation) raises. Prefill with
every_position, decode from explicit and from last-sampled tokens, multi-step decode,
Fork and Truncate are launched that way, through graphs and eagerly."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from executor.api import DecodeItem, PrefillItem, SamplingParams
from executor.steps import PendingStep
from tests.helpers.gpu import make_prefill_executor, rand_tokens

pytestmark = pytest.mark.gpu

SEEDED = SamplingParams(temperature=0.8, seed=4, logprobs=True, top_logprobs=2)


@contextmanager
def no_sync() -> Iterator[None]:
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_launches_never_synchronize(model_path: Path, graphs: bool) -> None:
    ex = make_prefill_executor(model_path, prefill="breakable" if graphs else "disabled",
                               decode="full" if graphs else "disabled")
    if graphs:
        ex.capture()
    # Warm-up outside the check: first uses load kernels and may allocate.
    ex.complete(ex.launch_prefill([PrefillItem("w", rand_tokens(40, 9), sampling=SEEDED,
                                               every_position=True)]))
    ex.complete(ex.launch_decode([DecodeItem("w", None, SEEDED)], num_steps=2))
    ex.release(["w"])
    launched: list[PendingStep] = []
    with no_sync():
        launched.append(ex.launch_prefill([
            PrefillItem("a", rand_tokens(50, 1), sampling=SEEDED),
            PrefillItem("b", rand_tokens(30, 2), sampling=SEEDED, every_position=True)]))
        launched.append(ex.launch_decode([DecodeItem("a", None, SEEDED),
                                          DecodeItem("b", 17, SEEDED)]))
        ex.fork("a", "c")
        ex.truncate("b", 20)
        launched.append(ex.launch_decode([DecodeItem("a", None, SEEDED),
                                          DecodeItem("c", None, SEEDED),
                                          DecodeItem("b", 5, SEEDED)], num_steps=3))
    results = [ex.complete(p) for p in launched]
    assert [o.seq_len for o in results[-1].outputs] == [54, 54, 23]
    assert len(results[0].outputs[1].positions) == 30
    if graphs:
        assert [r.step.path for r in results] == ["graph"] * 3
    ex.release(["a", "b", "c"])
    ex.kv.check_invariants()
