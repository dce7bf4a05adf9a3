"""Executor-level behaviour not covered by the HF-parity tests."""

from __future__ import annotations

import torch

from executor.api import DecodeItem, PrefillItem, SamplingParams
from executor.config import CacheConfig, ExecutorConfig
from executor.executor import Executor


def make() -> Executor:
    return Executor(ExecutorConfig(cache=CacheConfig(kv_tokens=512, max_sequences=4,
                                                     max_context=128)))


def test_device_table_mirrors_host_table_after_steps() -> None:
    ex = make()
    ex.prefill([PrefillItem("a", [1, 2, 3]), PrefillItem("b", [4])])
    ex.prefill([PrefillItem("a", [5, 6], sample=False)])
    ex.decode([DecodeItem("a", 7), DecodeItem("b", 8)])
    for sid in ("a", "b"):
        st = ex.kv.get(sid)
        assert st is not None
        assert torch.equal(ex.table.device_table[st.slot, : st.length],
                           ex.table.host_table[st.slot, : st.length])
    assert ex.kv.get("a").length == 6  # type: ignore[union-attr]


def test_non_sampling_chunk_returns_no_token_and_continues() -> None:
    ex = make()
    res = ex.prefill([PrefillItem("a", [1, 2, 3], sample=False), PrefillItem("b", [9])])
    a, b = res.outputs
    assert (a.token_id, a.seq_len) == (None, 3) and b.token_id is not None
    full = make()
    ref = full.prefill([PrefillItem("a", [1, 2, 3, 4, 5])]).outputs[0]
    got = ex.prefill([PrefillItem("a", [4, 5])]).outputs[0]
    assert (got.token_id, got.seq_len) == (ref.token_id, 5)


def test_outputs_in_request_order_with_logprobs_only_when_asked() -> None:
    ex = make()
    lp = SamplingParams(logprobs=True, top_logprobs=3)
    res = ex.prefill([PrefillItem("z", [1]), PrefillItem("y", [2], sampling=lp)])
    z, y = res.outputs
    assert (z.seq_id, y.seq_id) == ("z", "y")
    assert z.logprob is None and z.top_logprobs == ()
    assert y.logprob is not None and len(y.top_logprobs) == 3
    assert y.top_logprobs[0][0] == y.token_id  # greedy picks the top token
    assert res.step.phase == "prefill" and res.step.num_tokens == 2
    assert res.step.path == "eager" and res.step.fallback_reason == "no_cuda"
