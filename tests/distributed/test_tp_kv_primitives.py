"""Fork and every_position under tensor parallelism (CPU, gloo): the other ranks copy a
forked child's table row and inherited last token (``ForkHeader``), and keep one last token
per sequence when an every_position item samples at many rows. TP=2 on ``tiny`` must give
TP=1's tokens and log-probabilities."""

from __future__ import annotations

import pytest

from service.gen.model_executor.v1 import executor_pb2 as pb
from tests.distributed.serving import ServeProcess

LOGPROB_ATOL = 1e-4
TINY = ["--model", "tiny", "--kv-tokens", "512", "--max-context", "128", "--max-sequences",
        "8", "--drain-delay", "0"]
SCORED = pb.SamplingParams(logprobs=True, top_logprobs=3)


def _script(server: ServeProcess) -> list[tuple[str, int, float]]:
    stub, out = server.stub, []

    def take(outputs: object) -> None:
        for o in outputs:  # type: ignore[attr-defined]
            for p in o.positions:
                out.append((o.seq_id + "@", p.token_id, p.logprob))
            out.append((o.seq_id, o.token_id, o.logprob))

    take(stub.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(
        seq_id="p", token_ids=[(i * 31) % 500 + 2 for i in range(20)], sample=True,
        sampling=SCORED, every_position=True)]), timeout=60).outputs)
    assert stub.Fork(pb.ForkRequest(parent_seq_id="p", child_seq_id="c"), timeout=60
                     ).has_last_sampled
    stub.Fork(pb.ForkRequest(parent_seq_id="p", child_seq_id="d", prefix_len=9), timeout=60)
    stub.Truncate(pb.TruncateRequest(seq_id="p", length=4), timeout=60)
    take(stub.Prefill(pb.PrefillRequest(items=[
        pb.PrefillItem(seq_id="p", token_ids=[7, 8, 9], sample=True, sampling=SCORED),
        pb.PrefillItem(seq_id="d", token_ids=[40, 41, 42, 43], sample=True, sampling=SCORED,
                       every_position=True)]), timeout=60).outputs)
    for _ in range(4):
        take(stub.Decode(pb.DecodeRequest(items=[
            pb.DecodeItem(seq_id=s, use_last_sampled=True, sampling=SCORED)
            for s in ("p", "c", "d")]), timeout=60).outputs)
    released = stub.Release(pb.ReleaseRequest(seq_ids=["p", "c", "d"]), timeout=60)
    assert released.released == 3
    kv = stub.Health(pb.HealthRequest(), timeout=10).kv
    assert kv.free_tokens == kv.total_tokens and kv.shared_tokens == 0
    return out


def _run(args: list[str]) -> list[tuple[str, int, float]]:
    server = ServeProcess(args)
    try:
        server.wait_ready()
        return _script(server)
    finally:
        assert server.stop() == 0, "".join(server.lines)[-3000:]


def test_forks_and_every_position_under_tp2_equal_tp1() -> None:
    want = _run(TINY)
    got = _run([*TINY, "--tensor-parallel-size", "2"])
    assert [(s, t) for s, t, _ in got] == [(s, t) for s, t, _ in want]
    assert [lp for _, _, lp in got] == pytest.approx([lp for _, _, lp in want],
                                                     abs=LOGPROB_ATOL)
