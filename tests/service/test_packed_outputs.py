"""``DecodeRequest.packed_outputs``: the same outputs as flat arrays, unary and in a
Session, multi-step decode with stop tokens included."""

from __future__ import annotations

import math

import grpc
import pytest

from service.gen.model_executor.v1 import executor_pb2 as pb
from tests.service.harness import ServerHarness

SEEDED = pb.SamplingParams(temperature=1.1, seed=13, logprobs=True)
PLAIN = pb.SamplingParams(temperature=1.1, seed=13)


def unpack(packed: pb.PackedOutputs) -> list[tuple[list[int], list[float], int, bool]]:
    """Per item: tokens, logprobs (NaN-free or empty), seq_len, stopped."""
    out, at = [], 0
    for i, n in enumerate(packed.num_tokens):
        lps = list(packed.logprobs[at: at + n]) if packed.logprobs else []
        out.append((list(packed.token_ids[at: at + n]), lps, packed.seq_lens[i],
                    i in packed.stopped_items))
        at += n
    assert at == len(packed.token_ids)
    return out


def plain(outputs: list[pb.ItemOutput]) -> list[tuple[list[int], list[float], int, bool]]:
    rows = []
    for o in outputs:
        steps = list(o.steps) or [o]
        lps = [s.logprob if s.HasField("logprob") else math.nan for s in steps]
        rows.append(([s.token_id for s in steps], lps, o.seq_len, o.stopped))
    return rows


def same(a: list[tuple[list[int], list[float], int, bool]],
         b: list[tuple[list[int], list[float], int, bool]]) -> None:
    assert [(t, n, s) for t, _, n, s in a] == [(t, n, s) for t, _, n, s in b]
    for (_, la, _, _), (_, lb, _, _) in zip(a, b, strict=True):
        assert [x if not math.isnan(x) else None for x in la] == \
            [pytest.approx(x) if not math.isnan(x) else None for x in lb]


def test_packed_decode_equals_item_outputs(server: ServerHarness) -> None:
    before = server.kv()
    for prefix in ("u", "p"):
        server.stub.Prefill(pb.PrefillRequest(items=[
            pb.PrefillItem(seq_id=f"{prefix}{i}", token_ids=[5 + i, 9, 11, 2], sample=True)
            for i in range(3)]), timeout=30)

    def decode(prefix: str, packed: bool, **kw: object) -> pb.DecodeResponse:
        return server.stub.Decode(pb.DecodeRequest(packed_outputs=packed, items=[
            pb.DecodeItem(seq_id=f"{prefix}{i}", use_last_sampled=True,
                          sampling=SEEDED if i != 1 else PLAIN, **kw)  # type: ignore[arg-type]
            for i in range(3)]), timeout=30)

    a, b = decode("u", False), decode("p", True)
    assert not b.outputs and len(b.packed.num_tokens) == 3
    same(unpack(b.packed), plain(list(a.outputs)))
    assert math.isnan(b.packed.logprobs[1])  # item 1 did not ask
    # Multi-step with stop tokens: a third of the vocabulary stops, so items end early.
    stop = list(range(0, 512, 3))
    a = server.stub.Decode(pb.DecodeRequest(num_steps=4, items=[
        pb.DecodeItem(seq_id=f"u{i}", use_last_sampled=True, sampling=SEEDED,
                      stop_token_ids=stop) for i in range(3)]), timeout=30)
    assert any(o.stopped for o in a.outputs)
    b = server.stub.Decode(pb.DecodeRequest(num_steps=4, packed_outputs=True, items=[
        pb.DecodeItem(seq_id=f"p{i}", use_last_sampled=True, sampling=SEEDED,
                      stop_token_ids=stop) for i in range(3)]), timeout=30)
    same(unpack(b.packed), plain(list(a.outputs)))
    assert b.step.num_steps == 4
    server.stub.Release(pb.ReleaseRequest(seq_ids=[f"{p}{i}" for p in "up" for i in range(3)]),
                        timeout=30)
    assert server.kv() == before


def test_packed_decode_in_a_session_and_refusals(server: ServerHarness) -> None:
    before = server.kv()
    requests = [
        pb.SessionRequest(step=1, prefill=pb.PrefillRequest(items=[
            pb.PrefillItem(seq_id="ps", token_ids=[3, 4, 5], sample=True)])),
        pb.SessionRequest(step=2, decode=pb.DecodeRequest(packed_outputs=True, items=[
            pb.DecodeItem(seq_id="ps", use_last_sampled=True)])),
        pb.SessionRequest(step=3, decode=pb.DecodeRequest(packed_outputs=True, num_steps=3,
                                                          items=[pb.DecodeItem(
                                                              seq_id="ps",
                                                              use_last_sampled=True)])),
        pb.SessionRequest(step=4, release=pb.ReleaseRequest(seq_ids=["ps"]))]
    responses = list(server.stub.Session(iter(requests), timeout=30))
    assert [r.WhichOneof("result") for r in responses] == ["prefill", "decode", "decode",
                                                           "release"]
    assert list(responses[1].decode.packed.num_tokens) == [1]
    assert list(responses[2].decode.packed.seq_lens) == [7]
    assert len(responses[2].decode.packed.token_ids) == 3
    assert not responses[2].decode.packed.logprobs  # nobody asked
    with pytest.raises(grpc.RpcError) as info:
        server.stub.Decode(pb.DecodeRequest(packed_outputs=True, items=[pb.DecodeItem(
            seq_id="x", token_id=1, sampling=pb.SamplingParams(top_logprobs=2))]), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "packed_outputs carries no top log-probabilities" in str(info.value.details())
    assert server.kv() == before
