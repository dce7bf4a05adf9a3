"""Fork, Truncate and every_position under CUDA graphs (marker ``gpu``): forked and truncated
sequences replay the captured decode graphs and prefill pieces unchanged (their table rows
point at shared locations) and agree with eager execution."""

from __future__ import annotations

from pathlib import Path

import pytest

from executor.api import DecodeItem, PrefillItem, SamplingParams, StepResult
from executor.executor import Executor
from tests.helpers.gpu import clear_choices_agree, make_prefill_executor, rand_tokens

pytestmark = pytest.mark.gpu

PARAMS = SamplingParams(logprobs=True, top_logprobs=2)


def both(graphs: Executor, eager: Executor, call: object) -> tuple[StepResult, StepResult]:
    """One step on both executors (``call`` takes an executor)."""
    return call(graphs), call(eager)  # type: ignore[operator]


def run_script(graphs: Executor, eager: Executor) -> list[tuple[StepResult, StepResult]]:
    """Fork at the end and in the middle, rewrite the parent below the shared prefix,
    verify a draft with every_position, roll it back, decode all of them; both executors
    get the same calls, decode tokens chosen by the eager run."""
    out = [both(graphs, eager, lambda ex: ex.prefill([
        PrefillItem("p", rand_tokens(300, 1), sampling=PARAMS)]))]
    for ex in (graphs, eager):
        ex.fork("p", "c_all")
        ex.fork("p", "c_mid", prefix_len=170)
        ex.fork("c_mid", "g", prefix_len=90)  # a grandchild
        ex.truncate("p", 40)
    out.append(both(graphs, eager, lambda ex: ex.prefill([
        PrefillItem("p", rand_tokens(60, 2), sampling=PARAMS),
        PrefillItem("c_mid", rand_tokens(20, 3), sampling=PARAMS, every_position=True),
        PrefillItem("g", rand_tokens(7, 4), sampling=PARAMS)])))
    for ex in (graphs, eager):
        ex.truncate("c_mid", 180)  # keep 10 of the 20 verified tokens
    out.append(both(graphs, eager, lambda ex: ex.prefill([
        PrefillItem("c_mid", rand_tokens(1, 5), sampling=PARAMS)])))
    seqs = ["p", "c_all", "c_mid", "g"]
    toks = {o.seq_id: o.token_id for _, r in out for o in r.outputs}
    toks["c_all"] = out[0][1].outputs[0].token_id
    for _ in range(8):
        items = [DecodeItem(s, toks[s], PARAMS) for s in seqs]
        out.append(both(graphs, eager, lambda ex: ex.decode(items)))  # noqa: B023
        toks = {o.seq_id: o.token_id for o in out[-1][1].outputs}
    for ex in (graphs, eager):
        ex.release(seqs)
        ex.kv.check_invariants()
        assert ex.kv_stats().free_tokens == ex.kv_stats().total_tokens
    return out


@pytest.mark.parametrize("prefill", ["breakable", "tc_piecewise"])
def test_forked_and_truncated_sequences_under_graphs_equal_eager(model_path: Path,
                                                                 prefill: str) -> None:
    graphs = make_prefill_executor(model_path, prefill=prefill, decode="full")
    for phase in graphs.capture():
        assert all(b.ok for b in phase.buckets), phase
    eager = make_prefill_executor(model_path, prefill="disabled", decode="disabled")
    agree = total = 0
    for g, e in run_script(graphs, eager):
        agree += clear_choices_agree(g, e)
        total += len(e.outputs)
        for og, oe in zip(g.outputs, e.outputs, strict=True):
            assert og.seq_len == oe.seq_len
            assert len(og.positions) == len(oe.positions)
            for pg, pe in zip(og.positions, oe.positions, strict=True):
                (_, lp1), (_, lp2) = pe.top_logprobs
                if lp1 - lp2 > 0.05:
                    assert pg.token_id == pe.token_id
                if pe.next_token_logprob is not None:
                    assert pg.next_token_logprob == pytest.approx(pe.next_token_logprob,
                                                                  abs=0.1)
    assert agree >= total - 2  # bf16: at most a couple of near-ties differ
