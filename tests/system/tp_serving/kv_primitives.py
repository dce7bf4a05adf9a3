"""One session of Fork, Truncate and every_position calls through a served ``tiny``: the
transcript (tokens and log-probabilities) that TP = N must reproduce of TP = 1."""

from __future__ import annotations

from service.gen.model_executor.v1 import executor_pb2 as pb
from tests.helpers.serving import ServeProcess

LOGPROB_ATOL = 1e-4
TINY = ["--model", "tiny", "--kv-tokens", "512", "--max-context", "128", "--max-sequences",
        "8", "--drain-delay", "0"]
SCORED = pb.SamplingParams(logprobs=True, top_logprobs=3)


def script(server: ServeProcess) -> list[tuple[str, int, float]]:
    """The calls, on a ready server; (seq_id, token, logprob) of every output and position
    (position entries' seq_id end in ``@``)."""
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


def run(args: list[str]) -> list[tuple[str, int, float]]:
    """``serve`` with ``args``, the ``script`` on it, then a clean stop (exit code 0)."""
    server = ServeProcess(args)
    try:
        server.wait_ready()
        return script(server)
    finally:
        assert server.stop() == 0, "".join(server.lines)[-3000:]
