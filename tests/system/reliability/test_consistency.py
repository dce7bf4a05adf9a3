"""Issue 19, defect 14: Release follows the same id rules as Prefill and Decode (it accepted
"" and duplicates), and a call short of both KV tokens and sequence slots reports both (it
named only the tokens)."""

from __future__ import annotations

import grpc
import pytest

from service.gen.model_executor.v1 import executor_pb2 as pb
from tests.system.reliability.figures import Figures
from tests.system.reliability.support import (
    ServerHarness,
    check_kv,
    details,
    rpc_error,
    tiny_config,
)

FAILURES = "model_executor_kv_allocation_failures_total"
CONFIG = tiny_config(kv_tokens=64, max_sequences=2, max_context=64)


@pytest.mark.parametrize(("seq_ids", "field", "words"), [
    ([""], "seq_ids[0]", "non-empty"),
    (["a", "b", "a"], "seq_ids[2]", "more than once in one call (also seq_ids[0])"),
])
def test_release_rejects_empty_and_duplicate_ids(server: ServerHarness, seq_ids: list[str],
                                                 field: str, words: str) -> None:
    err = rpc_error(server.stub.Release, pb.ReleaseRequest(seq_ids=seq_ids))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    violation = details(err)["BadRequest"].field_violations[0]  # type: ignore[attr-defined]
    assert violation.field == field and words in violation.description


def test_both_shortages_are_reported(server: ServerHarness, figures: Figures) -> None:
    baseline = check_kv(server, figures)
    before = server.scrape()
    server.stub.Prefill(pb.PrefillRequest(items=[
        pb.PrefillItem(seq_id=s, token_ids=[5] * 30) for s in ("a", "b")]), timeout=30)
    try:
        err = rpc_error(server.stub.Prefill, pb.PrefillRequest(
            items=[pb.PrefillItem(seq_id="c", token_ids=[5] * 10)]))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        found = details(err)
        violations = [(v.subject, v.description)
                      for v in found["QuotaFailure"].violations]  # type: ignore[attr-defined]
        assert violations == [("kv_tokens", "needed 10, free 4"),
                              ("sequence_slots", "needed 1, free 0")]
        assert "KV tokens" in (err.details() or "") and "sequence slots" in (err.details() or "")
        after = server.scrape()
        for resource in ("kv_tokens", "sequence_slots"):
            key = (FAILURES, (("resource", resource),))
            assert after[key] == before[key] + 1
    finally:
        server.stub.Release(pb.ReleaseRequest(seq_ids=["a", "b"]), timeout=10)
    check_kv(server, figures, baseline)
