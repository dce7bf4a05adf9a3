"""Issue 19, defect 13: the proto said DEADLINE_EXCEEDED meant nothing was applied, but a
client-side deadline can expire after the server applied the step. The proto now states one
rule: DEADLINE_EXCEEDED or CANCELLED means the outcome is unknown (retry with the same
request_id, or Release). This reproduces the case and checks the documented rule holds."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import grpc
import pytest

from service.gen.model_executor.v1 import executor_pb2 as pb
from tests.service.harness import ServerHarness
from tests.system.reliability.support import Gate

PROTO = Path(__file__).resolve().parents[2] / "proto" / "model_executor" / "v1" / \
    "executor.proto"


def test_the_proto_says_outcome_unknown() -> None:
    text = PROTO.read_text()
    header = text[: text.index("syntax = ")]
    entry = header[header.index("DEADLINE_EXCEEDED"): header.index("INTERNAL")]
    entry = " ".join(w for w in entry.split() if w != "//")
    assert "CANCELLED" in entry and "OUTCOME UNKNOWN" in entry
    assert "same request_id" in entry and "Release" in entry
    assert not re.search(r"nothing\s+was\s+applied", entry)


def test_a_deadline_can_expire_after_the_step_applied(server: ServerHarness) -> None:
    request = pb.PrefillRequest(request_id="late-deadline", items=[
        pb.PrefillItem(seq_id="late", token_ids=[1, 2, 3, 4], sample=True)])
    with Gate(server, "prefill", hold="late") as gate:
        opener = threading.Thread(target=lambda: (gate.entered.wait(10),
                                                  threading.Event().wait(0.5), gate.open()))
        opener.start()
        with pytest.raises(grpc.RpcError) as info:
            server.stub.Prefill(request, timeout=0.3)
        opener.join(10)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    try:
        # The step was applied after all: the retry with the same request_id says so.
        retried = server.stub.Prefill(request, timeout=10)
        assert retried.outputs[0].seq_len == 4
        assert server.kv().active_sequences == 1
    finally:
        server.stub.Release(pb.ReleaseRequest(seq_ids=["late"]), timeout=10)
