"""Deadlines and cancellation, with a slow step injected on the executor thread (``Gate``):

| when                          | outcome                                       | KV           |
|-------------------------------|-----------------------------------------------|--------------|
| deadline passes while queued  | DEADLINE_EXCEEDED; never reaches the executor | unchanged    |
| cancelled while queued        | dropped; never reaches the executor           | unchanged    |
| deadline passes while running | completes; the client gets DEADLINE_EXCEEDED; | applied once |
|                               | a retry (same request_id) gets the result     |              |
| cancelled while running       | the same                                      | applied once |
"""

from __future__ import annotations

import grpc
import pytest

from service.gen.model_executor.v1 import executor_pb2 as pb
from tests.system.reliability.figures import Figures
from tests.system.reliability.support import (
    Gate,
    ServerHarness,
    check_kv,
    pending,
    rpc_error,
    wait_until,
)


def prefill(seq_id: str, n: int = 4, request_id: str = "") -> pb.PrefillRequest:
    return pb.PrefillRequest(request_id=request_id, items=[
        pb.PrefillItem(seq_id=seq_id, token_ids=[(7 * k + 3) % 500 for k in range(n)],
                       sample=True)])


def release(server: ServerHarness, *seq_ids: str) -> None:
    server.stub.Release(pb.ReleaseRequest(seq_ids=list(seq_ids)), timeout=10)


def test_deadline_passed_while_queued_never_runs(server: ServerHarness,
                                                 figures: Figures) -> None:
    baseline = check_kv(server, figures)
    server.stub.Prefill(prefill("d-known"), timeout=10)
    before = check_kv(server, figures)
    with Gate(server, "prefill", hold="blocker") as gate:
        blocker = server.stub.Prefill.future(prefill("blocker"), timeout=30)
        assert gate.entered.wait(10)
        late = [server.stub.Prefill.future(prefill("d-late", request_id="d-late-1"),
                                           timeout=0.3),
                server.stub.Decode.future(pb.DecodeRequest(items=[
                    pb.DecodeItem(seq_id="d-known", token_id=5)]), timeout=0.3)]
        for future in late:
            with pytest.raises(grpc.RpcError) as info:
                future.result()
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        gate.open()
        assert blocker.result().outputs[0].seq_len == 4
    assert ["d-late"] not in gate.calls and ["d-known"] not in gate.calls
    after = check_kv(server, figures)
    assert after.free_tokens == before.free_tokens - 4  # the blocker's 4 tokens only
    assert after.active_sequences == before.active_sequences + 1
    # a retry of the expired call runs now: it never ran, so nothing is remembered
    assert server.stub.Prefill(prefill("d-late", request_id="d-late-1"),
                               timeout=10).outputs[0].seq_len == 4
    release(server, "blocker", "d-known", "d-late")
    check_kv(server, figures, expected=baseline)


def test_cancelled_while_queued_is_dropped(server: ServerHarness, figures: Figures) -> None:
    baseline = check_kv(server, figures)
    with Gate(server, "prefill", hold="blocker") as gate:
        blocker = server.stub.Prefill.future(prefill("blocker"), timeout=30)
        assert gate.entered.wait(10)
        queued = [server.stub.Prefill.future(prefill(f"c{i}", request_id=f"c{i}-1"),
                                             timeout=30) for i in range(3)]
        wait_until(lambda: pending(server) == 4, what="calls queued")
        for future in queued[:2]:
            future.cancel()
        wait_until(lambda: pending(server) == 2, what="cancelled calls dropped")
        gate.open()
        assert blocker.result().outputs[0].seq_len == 4
        assert queued[2].result().outputs[0].seq_len == 4
    assert ["c0"] not in gate.calls and ["c1"] not in gate.calls and ["c2"] in gate.calls
    stats = check_kv(server, figures)
    assert stats.active_sequences == baseline.active_sequences + 2
    release(server, "blocker", "c2")
    check_kv(server, figures, expected=baseline)


@pytest.mark.parametrize("how", ["deadline", "cancel"])
def test_running_call_completes_and_its_retry_gets_the_result(
        server: ServerHarness, figures: Figures, how: str) -> None:
    """The client gives up while its step runs: the step finishes and is applied once; the
    retry (same request_id) gets that step's response and runs nothing."""
    baseline = check_kv(server, figures)
    request = prefill("slow", n=6, request_id=f"slow-{how}")
    with Gate(server, "prefill", hold="slow") as gate:
        if how == "deadline":
            err = rpc_error(server.stub.Prefill, request, timeout=0.3)
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        else:
            future = server.stub.Prefill.future(request, timeout=30)
            assert gate.entered.wait(10)
            future.cancel()
            assert future.cancelled()
        assert gate.entered.is_set()  # it was running, not queued
        gate.open()
        wait_until(lambda: pending(server) == 0, what="the step finished")
    applied = check_kv(server, figures)
    assert applied.free_tokens == baseline.free_tokens - 6
    hits = ("model_executor_retry_cache_hits_total", (("method", "Prefill"),))
    before = server.scrape()[hits]
    retry = server.stub.Prefill(request, timeout=10)
    assert retry.outputs[0].seq_len == 6 and retry.outputs[0].HasField("token_id")
    assert server.scrape()[hits] == before + 1  # answered from the kept response
    assert gate.calls.count(["slow"]) == 1
    check_kv(server, figures, expected=applied)  # the retry appended nothing
    # decoding continues from the retried result as if the first reply had arrived
    step = server.stub.Decode(pb.DecodeRequest(items=[
        pb.DecodeItem(seq_id="slow", token_id=retry.outputs[0].token_id)]), timeout=10)
    assert step.outputs[0].seq_len == 7
    release(server, "slow")
    check_kv(server, figures, expected=baseline)
