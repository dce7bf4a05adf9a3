"""``Truncate`` over a real channel: roll back a draft tail, statuses for bad calls."""

from __future__ import annotations

import grpc
import pytest

from service.gen.model_executor.v1 import executor_pb2 as pb
from tests.service.harness import ServerHarness


def test_truncate_rolls_back_a_draft_and_frees_its_kv(server: ServerHarness) -> None:
    before = server.kv()
    server.stub.Prefill(pb.PrefillRequest(items=[
        pb.PrefillItem(seq_id="tr", token_ids=[3, 1, 4, 1, 5, 9, 2, 6], sample=True)]),
        timeout=30)
    response = server.stub.Truncate(pb.TruncateRequest(seq_id="tr", length=5), timeout=30)
    assert (response.seq_len, response.freed_tokens) == (5, 3)
    assert server.kv().free_tokens == before.free_tokens - 5
    again = server.stub.Truncate(pb.TruncateRequest(seq_id="tr", length=5), timeout=30)
    assert (again.seq_len, again.freed_tokens) == (5, 0)  # a retry changes nothing
    with pytest.raises(grpc.RpcError) as info:  # its last sample went with the tail
        server.stub.Decode(pb.DecodeRequest(items=[
            pb.DecodeItem(seq_id="tr", use_last_sampled=True)]), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    out = server.stub.Decode(pb.DecodeRequest(items=[pb.DecodeItem(seq_id="tr", token_id=7)]),
                             timeout=30).outputs[0]
    assert out.seq_len == 6
    server.stub.Release(pb.ReleaseRequest(seq_ids=["tr"]), timeout=30)
    assert server.kv() == before


@pytest.mark.parametrize(("seq_id", "length", "code", "text"), [
    ("missing", 0, grpc.StatusCode.NOT_FOUND, "missing"),
    ("tb", 9, grpc.StatusCode.INVALID_ARGUMENT, "must be in [0, 3]"),
    ("tb", -2, grpc.StatusCode.INVALID_ARGUMENT, "must be >= 0"),
    ("", 0, grpc.StatusCode.INVALID_ARGUMENT, "seq_id"),
])
def test_bad_truncates_are_refused_and_change_nothing(server: ServerHarness, seq_id: str,
                                                      length: int, code: grpc.StatusCode,
                                                      text: str) -> None:
    server.stub.Prefill(pb.PrefillRequest(items=[
        pb.PrefillItem(seq_id="tb", token_ids=[1, 2, 3])]), timeout=30)
    before = server.kv()
    with pytest.raises(grpc.RpcError) as info:
        server.stub.Truncate(pb.TruncateRequest(seq_id=seq_id, length=length), timeout=30)
    assert info.value.code() == code and text in str(info.value.details())
    assert server.kv() == before
    server.stub.Release(pb.ReleaseRequest(seq_ids=["tb"]), timeout=30)


def test_verify_a_draft_with_every_position_then_roll_back(server: ServerHarness) -> None:
    """Speculative decoding over the wire: one Prefill scores every draft position
    (PrefillItem.every_position), a Truncate drops the rejected tail."""
    before = server.kv()
    first = server.stub.Prefill(pb.PrefillRequest(items=[
        pb.PrefillItem(seq_id="sv", token_ids=[8, 6, 7, 5, 3], sample=True)]),
        timeout=30).outputs[0]
    draft = [first.token_id, 11, 12, 13]
    out = server.stub.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(
        seq_id="sv", token_ids=draft, sample=True, every_position=True,
        sampling=pb.SamplingParams(logprobs=True, top_logprobs=2))]), timeout=30).outputs[0]
    assert len(out.positions) == 4 and out.seq_len == 9
    assert all(p.HasField("next_token_logprob") for p in out.positions[:3])
    assert not out.positions[3].HasField("next_token_logprob")
    assert all(len(p.top_logprobs) == 2 and p.HasField("logprob") for p in out.positions)
    assert out.token_id == out.positions[-1].token_id
    accepted = next((i for i in range(3) if draft[i + 1] != out.positions[i].token_id), 3)
    server.stub.Truncate(pb.TruncateRequest(seq_id="sv", length=6 + accepted), timeout=30)
    with pytest.raises(grpc.RpcError) as info:
        server.stub.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(
            seq_id="sv", token_ids=[1], sample=False, every_position=True)]), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "every_position: needs sample" in str(info.value.details())
    server.stub.Release(pb.ReleaseRequest(seq_ids=["sv"]), timeout=30)
    assert server.kv() == before
