"""Tensor parallelism on two GPUs (marker ``gpu``; skips with fewer): a real
``serve --tensor-parallel-size 2`` (and 4, where four GPUs are) on the random-weight
Llama-3.2-1B shape (bf16) against ``--tensor-parallel-size 1``, both replaying graphs with
the all-reduces captured inside.

Both servers get the same calls, lockstep, and decode the TP = 1 server's tokens, so one
near-tie cannot send them down different paths. bf16 tolerance: wherever the TP = 1 top-2
log-probability margin exceeds 0.05 the tokens must be equal, and every sampled token's
log-probability within 0.1 (all-reduce order changes bf16 rounding)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from bench.common.shapes import write_shape
from bench.e2e.tensor_parallel import allreduce_us, serve, stop
from executor.distributed.all_reduce.auto import AUTO_PROBE_BYTES, size_plan
from service.gen.model_executor.v1 import executor_pb2 as pb
from service.gen.model_executor.v1 import executor_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 GPUs (tensor parallelism)")]

SCORED = pb.SamplingParams(logprobs=True, top_logprobs=2)
MARGIN, LOGPROB_ATOL = 0.05, 0.1


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_shape("llama-3.2-1b", tmp_path_factory.mktemp("tp"))


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, 128000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=[
    (2, "breakable", "flags", "on"), (2, "tc_piecewise", "auto", "on"),
    (2, "fixed_grid", "auto", "off"),
    pytest.param((4, "breakable", "auto", "on"), marks=pytest.mark.skipif(
        torch.cuda.device_count() < 4, reason="TP = 4 needs 4 GPUs"))],
    ids=lambda p: f"tp{p[0]}-{p[1]}-{p[2]}" + {"on": "", "off": "-no-send"}[p[3]])
def servers(request: pytest.FixtureRequest, model: Path
            ) -> Iterator[tuple[pb_grpc.ExecutorStub, pb_grpc.ExecutorStub]]:
    """TP = 1 and TP = N servers; the first pair with the flag kernel, the others under
    "auto" (which usually plans the push kernel): with the projections' GEMMs sending into
    it (``--tp-gemm-send on``, the default), and with a separate all-reduce after each
    (``off``)."""
    size, prefill, algo, send = request.param
    extra = ["--prefill-graph", prefill, "--tp-all-reduce", algo, "--tp-gemm-send", send]
    procs: list[subprocess.Popen[bytes]] = []
    stubs = []
    try:
        for tp in (1, size):
            proc, target, _ = serve(model, tp, extra)
            procs.append(proc)
            stubs.append(pb_grpc.ExecutorStub(grpc.insecure_channel(target)))
        yield stubs[0], stubs[1]
    finally:
        for proc in procs:
            stop(proc)


def _agree(ref: pb.ItemOutput, got: pb.ItemOutput) -> bool:
    (_, lp1), (_, lp2) = [(t.token_id, t.logprob) for t in ref.top_logprobs]
    if lp1 - lp2 > MARGIN:
        assert got.token_id == ref.token_id, (ref, got)
    assert got.logprob == pytest.approx(ref.logprob, abs=LOGPROB_ATOL)
    assert got.seq_len == ref.seq_len
    return got.token_id == ref.token_id


def test_tp_equals_tp1_under_graphs(servers: tuple[pb_grpc.ExecutorStub,
                                                    pb_grpc.ExecutorStub]) -> None:
    """Chunked prefill (graph pieces), 12 decode steps at batch 3 (full decode graph), a
    4-step decode from the tokens on the device, a Session with two steps in flight,
    Release: TP = N reproduces TP = 1."""
    ref, tp2 = servers
    prompts = {"a": _tokens(1, 300), "b": _tokens(2, 45), "c": _tokens(3, 700)}
    agree = total = 0

    def both(method: str, request: object) -> tuple[object, object]:
        return (getattr(ref, method)(request, timeout=120),
                getattr(tp2, method)(request, timeout=120))

    both("Prefill", pb.PrefillRequest(items=[
        pb.PrefillItem(seq_id=s, token_ids=p[: len(p) // 2]) for s, p in prompts.items()]))
    r, g = both("Prefill", pb.PrefillRequest(items=[
        pb.PrefillItem(seq_id=s, token_ids=p[len(p) // 2:], sample=True, sampling=SCORED)
        for s, p in prompts.items()]))
    for resp in (r, g):
        assert resp.step.path == pb.PATH_GRAPH  # type: ignore[attr-defined]
    last = {}
    for ro, go in zip(r.outputs, g.outputs, strict=True):  # type: ignore[attr-defined]
        agree += _agree(ro, go)
        total += 1
        last[ro.seq_id] = ro.token_id
    for _ in range(12):
        r, g = both("Decode", pb.DecodeRequest(items=[
            pb.DecodeItem(seq_id=s, token_id=t, sampling=SCORED) for s, t in last.items()]))
        assert r.step.path == g.step.path == pb.PATH_GRAPH  # type: ignore[attr-defined]
        for ro, go in zip(r.outputs, g.outputs, strict=True):  # type: ignore[attr-defined]
            agree += _agree(ro, go)
            total += 1
            last[ro.seq_id] = ro.token_id
    assert agree >= total - 2, f"{agree} of {total} tokens agree"
    # batch 1 (one sequence): with --tp-gemm-send on and the push kernel, o_proj and
    # down_proj send their rows into its buffers (the skinny GEMMs serve one row only)
    one = {"b": last["b"]}
    for _ in range(4):
        r, g = both("Decode", pb.DecodeRequest(items=[
            pb.DecodeItem(seq_id=s, token_id=t, sampling=SCORED) for s, t in one.items()]))
        assert r.step.path == g.step.path == pb.PATH_GRAPH  # type: ignore[attr-defined]
        (ro,), (go,) = r.outputs, g.outputs  # type: ignore[attr-defined]
        agree += _agree(ro, go)
        total += 1
        one["b"] = last["b"] = ro.token_id
    r, g = both("Decode", pb.DecodeRequest(num_steps=4, items=[
        pb.DecodeItem(seq_id=s, token_id=t) for s, t in last.items()]))
    assert [o.seq_len for o in g.outputs] == [o.seq_len for o in r.outputs]  # type: ignore[attr-defined]

    # A Session with two steps in flight (the servers' default depth): the first step from
    # the same tokens on both servers (TP = 1's last samples: the multi-step decode above
    # compares lengths only), every later one from the tokens each server sampled on its
    # devices; rank 0 launches a step, on every rank, before the one ahead of it has
    # finished. Compared up to the first token the two may take differently (a near
    # tie), after which their inputs differ.
    first = {o.seq_id: o.token_id for o in r.outputs}  # type: ignore[attr-defined]

    def session() -> Iterator[pb.SessionRequest]:
        for n in range(1, 7):
            yield pb.SessionRequest(step=n, decode=pb.DecodeRequest(items=[
                pb.DecodeItem(seq_id=s, sampling=SCORED, **(
                    {"token_id": first[s]} if n == 1 else {"use_last_sampled": True}))
                for s in prompts]))

    answers = [list(stub.Session(session(), timeout=120)) for stub in (ref, tp2)]
    assert len(answers[0]) == len(answers[1]) == 6
    for rs, gs in zip(*answers, strict=True):
        assert rs.WhichOneof("result") == gs.WhichOneof("result") == "decode", (rs, gs)
        assert rs.decode.step.path == gs.decode.step.path == pb.PATH_GRAPH
        if not all([_agree(ro, go) for ro, go in zip(rs.decode.outputs, gs.decode.outputs,
                                                       strict=True)]):
            break
    both("Release", pb.ReleaseRequest(seq_ids=list(prompts)))
    kv = [stub.Health(pb.HealthRequest(), timeout=10).kv for stub in (ref, tp2)]
    assert [k.free_tokens for k in kv] == [k.total_tokens for k in kv]


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.skipif(
    torch.cuda.device_count() < 4, reason="needs 4 GPUs"))])
def test_all_reduce_algorithms_sum_exactly_eager_and_inside_graphs(world: int) -> None:
    """Every ``--tp-all-reduce`` choice through ``TensorParallel.all_reduce`` on 2 (4) GPUs:
    exact integer sums in bf16, eagerly and replayed from a graph of 32 back-to-back
    all-reduces; "symm_mem" takes the symmetric-memory kernel on NVLink-connected GPUs,
    "flags" our flag kernel over the same memory, "push" our push kernel (with
    each graph call its own values, a region read before its data arrived, or not marked
    empty again after, fails), and a size over ``ONE_SHOT_MAX_BYTES``
    (600 x 2048 bf16) goes to NCCL inside both. A row-parallel projection's output sent
    by its GEMM into the push all-reduce (``linear_all_reduce``) equals the two calls."""
    got = allreduce_us(world, 2048, sizes=[1, 8, 64, 600])
    assert got["nccl"] == {**got["nccl"], "algorithm": "nccl", "ok": True}, got
    for algo in ("symm_mem", "flags", "push"):
        assert got[algo] == {**got[algo], "algorithm": algo, "ok": True}, got
    # A one-row projection sending its output into the push all-reduce: taken where the
    # push kernel runs the all-reduce (not through NCCL or the other kernels), and the same
    # bits as the projection then the all-reduce, eagerly and from graphs.
    for algo, result in got.items():
        assert result["send"]["ok"] is True, (algo, result["send"])
        assert result["send"]["sends"] is (algo == "push" or (
            algo == "auto" and result["algorithm"].startswith("push"))), got
    # "auto" timed each path at start-up and shared the sizes out by the slowest rank's
    # times: the plan is what size_plan makes of them, and the algorithm names its paths.
    auto = got["auto"]
    assert auto["ok"], got
    choice = auto["choice"]
    slowest = choice["slowest_rank_us"]
    assert sorted(slowest) == ["flags", "nccl", "push", "symm_mem"], choice
    for algo, times in slowest.items():  # rank 0's own times are no slower than the worst
        assert len(times) == len(AUTO_PROBE_BYTES), choice
        assert all(mine <= worst + 0.01 for mine, worst in zip(
            choice[f"{algo}_us"], times, strict=True)), choice
    plan = [(p["algorithm"], p["up_to_bytes"]) for p in choice["plan"]]
    assert plan == size_plan(AUTO_PROBE_BYTES, slowest), choice
    assert auto["algorithm"] == ("+".join(dict.fromkeys(a for a, _ in plan)) or "nccl"), got
