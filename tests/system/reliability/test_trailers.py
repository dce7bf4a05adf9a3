"""Issue 19, defect 3: an error's trailers stay small whatever the request held.

gRPC-core clients drop a response whose trailers exceed 16 KiB and report RESOURCE_EXHAUSTED
("received metadata size exceeds hard limit") instead of the real status. These tests send
1,000 bad items through the Python client and check that the real code arrives, with the
first violations listed and the rest counted."""

from __future__ import annotations

import uuid

import grpc
from grpc_status import rpc_status

from service.errors import MAX_DETAIL_ITEMS
from service.gen.model_executor.v1 import executor_pb2 as pb
from tests.system.reliability.support import ServerHarness, details, rpc_error, tiny_config

N = 1000
LONG_ID = "\u00e9" * 200  # 400 bytes of UTF-8: over the 256-byte seq_id limit
CONFIG = tiny_config(kv_tokens=2048, max_sequences=1024, max_context=64,
                     max_prefill_tokens=2048)


def _trailer_bytes(err: grpc.RpcError) -> int:
    return sum(len(k) + len(v) for k, v in err.trailing_metadata() or ())  # type: ignore[attr-defined]


def test_decode_of_1000_unknown_ids_gets_not_found(server: ServerHarness) -> None:
    request = pb.DecodeRequest(items=[pb.DecodeItem(seq_id=str(uuid.uuid4()), token_id=1)
                                      for _ in range(N)])
    err = rpc_error(server.stub.Decode, request)
    assert err.code() == grpc.StatusCode.NOT_FOUND, err.details()
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None
    assert len(status.details) == MAX_DETAIL_ITEMS + 1  # resources + one ErrorInfo
    assert details(err)["ErrorInfo"].metadata["unknown_seq_ids"] == str(N)  # type: ignore[attr-defined]
    assert f"+{N - 3} more" in (err.details() or "")
    assert _trailer_bytes(err) < 8 * 1024


def test_prefill_of_1000_bad_items_gets_invalid_argument(server: ServerHarness) -> None:
    bad = pb.SamplingParams(temperature=-1.0, top_p=2.0, min_p=3.0, top_logprobs=99)
    request = pb.PrefillRequest(items=[
        pb.PrefillItem(seq_id=f"{LONG_ID}{i}", token_ids=[1], sample=True, sampling=bad)
        for i in range(N)])
    err = rpc_error(server.stub.Prefill, request)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    violations = details(err)["BadRequest"].field_violations  # type: ignore[attr-defined]
    assert len(violations) == MAX_DETAIL_ITEMS + 1
    assert violations[0].field == "items[0].seq_id"
    assert f"{5 * N - MAX_DETAIL_ITEMS} more violations" in violations[-1].description
    assert len((err.details() or "").encode()) <= 512
    assert _trailer_bytes(err) < 8 * 1024
    assert server.kv().active_sequences == 0


def test_release_of_1000_bad_ids_gets_invalid_argument(server: ServerHarness) -> None:
    err = rpc_error(server.stub.Release,
                    pb.ReleaseRequest(seq_ids=[f"{LONG_ID}{i}" for i in range(N)]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert _trailer_bytes(err) < 8 * 1024
