"""``Fork`` over a real channel: shared prefixes in Health and the metrics, a retry by
request_id, statuses for bad calls, and Fork as a Session step."""

from __future__ import annotations

import grpc
import pytest

from service.gen.model_executor.v1 import executor_pb2 as pb
from tests.service.harness import ServerHarness

SEEDED = pb.SamplingParams(temperature=0.9, seed=5, logprobs=True)


def admit(server: ServerHarness, seq_id: str, tokens: list[int]) -> pb.ItemOutput:
    return server.stub.Prefill(pb.PrefillRequest(items=[
        pb.PrefillItem(seq_id=seq_id, token_ids=tokens, sample=True, sampling=SEEDED)]),
        timeout=30).outputs[0]


def gauge(server: ServerHarness, name: str) -> float:
    return server.scrape()[(f"model_executor_{name}", ())]


def test_fork_shares_the_prefix_and_counts_it_once(server: ServerHarness) -> None:
    before = server.kv()
    admit(server, "fp", [5, 6, 7, 8, 9, 10])
    child = server.stub.Fork(pb.ForkRequest(parent_seq_id="fp", child_seq_id="fc"),
                             timeout=30)
    assert (child.seq_len, child.shared_tokens, child.has_last_sampled) == (6, 6, True)
    part = server.stub.Fork(pb.ForkRequest(parent_seq_id="fc", child_seq_id="fg",
                                           prefix_len=0), timeout=30)
    assert (part.seq_len, part.has_last_sampled) == (0, False)
    kv = server.kv()
    assert kv.free_tokens == before.free_tokens - 6  # three sequences, six locations
    assert (kv.shared_tokens, kv.forked_sequences) == (6, 2)
    assert (gauge(server, "kv_shared_tokens"), gauge(server, "forked_sequences")) == (6, 2)
    # Parent and child both continue from the token the parent sampled: same seed, same
    # tokens and positions give the same next token.
    out = server.stub.Decode(pb.DecodeRequest(items=[
        pb.DecodeItem(seq_id=s, use_last_sampled=True, sampling=SEEDED)
        for s in ("fp", "fc")]), timeout=30).outputs
    assert out[0].token_id == out[1].token_id and out[0].seq_len == out[1].seq_len == 7
    released = server.stub.Release(pb.ReleaseRequest(seq_ids=["fp"]), timeout=30)
    assert (released.released, released.freed_tokens) == (1, 1)  # only its own token
    released = server.stub.Release(pb.ReleaseRequest(seq_ids=["fc", "fg"]), timeout=30)
    assert (released.released, released.freed_tokens) == (2, 7)
    kv = server.kv()
    assert kv == before and (kv.shared_tokens, kv.forked_sequences) == (0, 0)


def test_a_retried_fork_returns_the_original(server: ServerHarness) -> None:
    before = server.kv()
    admit(server, "rp", [1, 2, 3, 4])
    request = pb.ForkRequest(request_id="fork-1", parent_seq_id="rp", child_seq_id="rc",
                             prefix_len=3)
    first = server.stub.Fork(request, timeout=30)
    assert server.stub.Fork(request, timeout=30) == first  # not INVALID_ARGUMENT
    assert server.kv().forked_sequences == 1
    other = pb.ForkRequest(request_id="fork-1", parent_seq_id="rp", child_seq_id="rd")
    with pytest.raises(grpc.RpcError) as info:
        server.stub.Fork(other, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "already used by a different call" in str(info.value.details())
    server.stub.Release(pb.ReleaseRequest(seq_ids=["rc"]), timeout=30)
    with pytest.raises(grpc.RpcError) as info:  # it applied; its child is gone since
        server.stub.Fork(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.ABORTED
    server.stub.Release(pb.ReleaseRequest(seq_ids=["rp"]), timeout=30)
    assert server.kv() == before


@pytest.mark.parametrize(("parent", "child", "prefix", "code", "text"), [
    ("missing", "x", None, grpc.StatusCode.NOT_FOUND, "missing"),
    ("bp", "bp", None, grpc.StatusCode.INVALID_ARGUMENT, "already exists"),
    ("bp", "x", 4, grpc.StatusCode.INVALID_ARGUMENT, "must be in [0, 3]"),
    ("bp", "x", -1, grpc.StatusCode.INVALID_ARGUMENT, "must be >= 0"),
    ("bp", "", None, grpc.StatusCode.INVALID_ARGUMENT, "child_seq_id"),
    ("", "x", None, grpc.StatusCode.INVALID_ARGUMENT, "parent_seq_id"),
    ("bp", "x" * 300, None, grpc.StatusCode.INVALID_ARGUMENT, "at most 256 bytes"),
])
def test_bad_forks_are_refused_and_change_nothing(server: ServerHarness, parent: str,
                                                  child: str, prefix: int | None,
                                                  code: grpc.StatusCode, text: str) -> None:
    admit(server, "bp", [1, 2, 3])
    before = server.kv()
    request = pb.ForkRequest(parent_seq_id=parent, child_seq_id=child)
    if prefix is not None:
        request.prefix_len = prefix
    with pytest.raises(grpc.RpcError) as info:
        server.stub.Fork(request, timeout=30)
    assert info.value.code() == code and text in str(info.value.details())
    assert server.kv() == before
    server.stub.Release(pb.ReleaseRequest(seq_ids=["bp"]), timeout=30)


def test_fork_as_a_session_step(server: ServerHarness) -> None:
    """Parallel sampling on one stream: prefill, fork two children after it, decode all
    three from the device's last sample in the next step, release."""
    before = server.kv()
    first = pb.PrefillRequest(items=[pb.PrefillItem(seq_id="sp", token_ids=[4, 4, 2, 9],
                                                    sample=True, sampling=SEEDED)])
    requests = [
        pb.SessionRequest(step=1, prefill=first),
        pb.SessionRequest(step=2, fork=pb.ForkRequest(parent_seq_id="sp", child_seq_id="s1")),
        pb.SessionRequest(step=3, fork=pb.ForkRequest(parent_seq_id="sp", child_seq_id="s2")),
        pb.SessionRequest(step=4, decode=pb.DecodeRequest(items=[
            pb.DecodeItem(seq_id=s, use_last_sampled=True, sampling=SEEDED)
            for s in ("sp", "s1", "s2")])),
        pb.SessionRequest(step=5, fork=pb.ForkRequest(parent_seq_id="sp", child_seq_id="s1")),
        pb.SessionRequest(step=6, release=pb.ReleaseRequest(seq_ids=["sp", "s1", "s2"]),
                          ack_failed_step=5)]
    responses = list(server.stub.Session(iter(requests), timeout=30))
    kinds = [r.WhichOneof("result") for r in responses]
    assert kinds == ["prefill", "fork", "fork", "decode", "error", "release"]
    assert responses[1].fork.seq_len == 4 and responses[2].fork.has_last_sampled
    tokens = {o.token_id for o in responses[3].decode.outputs}
    assert len(tokens) == 1  # the same seed, tokens and position
    assert responses[4].error.code_name == "INVALID_ARGUMENT"
    assert responses[5].release.freed_tokens == 4 + 3
    assert server.kv() == before
