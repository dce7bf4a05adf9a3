"""Issue 19, defect 6: a call that can never fit is INVALID_ARGUMENT, not a retryable
RESOURCE_EXHAUSTED (a scheduler would retry it forever), and Health's max_context says what
can actually be served: here a 64-token pool under a 256-token max_context."""

from __future__ import annotations

import grpc

from service.gen.model_executor.v1 import executor_pb2 as pb
from tests.system.reliability.figures import Figures
from tests.system.reliability.support import (
    ServerHarness,
    check_kv,
    details,
    rpc_error,
    tiny_config,
)

POOL = 64
CONFIG = tiny_config(kv_tokens=POOL, max_sequences=4, max_context=256,
                     max_prefill_tokens=512)


def prefill(*spec: tuple[str, int]) -> pb.PrefillRequest:
    return pb.PrefillRequest(items=[pb.PrefillItem(seq_id=s, token_ids=[5] * n, sample=True)
                                    for s, n in spec])


def assert_never_fits(err: grpc.RpcError, field: str) -> None:
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    found = details(err)
    assert "RetryInfo" not in found
    fields = [v.field for v in found["BadRequest"].field_violations]  # type: ignore[attr-defined]
    assert field in fields
    assert f"the KV pool holds {POOL}" in (err.details() or "")


def test_health_reports_what_can_be_served(server: ServerHarness) -> None:
    assert server.stub.Health(pb.HealthRequest(), timeout=5).model.max_context == POOL


def test_prompt_longer_than_the_pool_is_invalid(server: ServerHarness,
                                                figures: Figures) -> None:
    baseline = check_kv(server, figures)
    assert_never_fits(rpc_error(server.stub.Prefill, prefill(("long", POOL + 1))),
                      "items[0].token_ids")
    # A call whose items fit one by one but not together can never fit either.
    assert_never_fits(rpc_error(server.stub.Prefill, prefill(("a", 40), ("b", 40))), "items")
    check_kv(server, figures, baseline)


def test_extension_and_decode_past_the_pool_are_invalid(server: ServerHarness,
                                                        figures: Figures) -> None:
    baseline = check_kv(server, figures)
    server.stub.Prefill(prefill(("s", POOL - 1)), timeout=30)
    assert_never_fits(rpc_error(server.stub.Prefill, prefill(("s", 2))), "items[0].token_ids")
    server.stub.Decode(pb.DecodeRequest(items=[pb.DecodeItem(seq_id="s", token_id=1)]),
                      timeout=30)
    assert_never_fits(rpc_error(server.stub.Decode, pb.DecodeRequest(
        items=[pb.DecodeItem(seq_id="s", token_id=1)])), "items[0].token_id")
    server.stub.Release(pb.ReleaseRequest(seq_ids=["s"]), timeout=10)
    check_kv(server, figures, baseline)


def test_the_message_quotes_the_max_context_health_reports(server: ServerHarness) -> None:
    """The limit in the message is Health's ``max_context`` (what can be served), never the
    configured 256 the pool cannot hold."""
    served = server.stub.Health(pb.HealthRequest(), timeout=5).model.max_context
    text = rpc_error(server.stub.Prefill, prefill(("long", POOL + 1))).details() or ""
    assert f"max_context is {served}" in text and "256" not in text, text


def test_too_many_steps_name_num_steps(server: ServerHarness, figures: Figures) -> None:
    """Steps that can never fit on a ``use_last_sampled`` item name ``num_steps`` (one step
    would fit), and one step past the pool names the field the item used."""
    baseline = check_kv(server, figures)
    server.stub.Prefill(prefill(("s", POOL - 2)), timeout=30)
    try:
        steps = pb.DecodeRequest(items=[pb.DecodeItem(seq_id="s", use_last_sampled=True)],
                                 num_steps=4)
        assert_never_fits(rpc_error(server.stub.Decode, steps), "num_steps")
        one = pb.DecodeRequest(items=[pb.DecodeItem(seq_id="s", use_last_sampled=True)])
        server.stub.Decode(one, timeout=30)
        server.stub.Decode(one, timeout=30)  # the pool is full: POOL tokens
        assert_never_fits(rpc_error(server.stub.Decode, one), "items[0].use_last_sampled")
    finally:
        server.stub.Release(pb.ReleaseRequest(seq_ids=["s"]), timeout=10)
    check_kv(server, figures, baseline)


def test_a_call_that_fits_later_is_still_retryable(server: ServerHarness) -> None:
    server.stub.Prefill(prefill(("x", 40)), timeout=30)
    try:
        err = rpc_error(server.stub.Prefill, prefill(("y", 30)))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "RetryInfo" in details(err)
    finally:
        server.stub.Release(pb.ReleaseRequest(seq_ids=["x"]), timeout=10)
