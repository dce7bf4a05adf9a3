"""Fuzzing a live server. Hypothesis generates valid and invalid requests and random call
sequences (admit, extend, decode, release, retry, health); bytes that are not the method's
message are sent at every method. Whatever comes in: no INTERNAL (or UNKNOWN), no hang
(every call has a deadline), the accounting invariant holds after every call and matches a
model of the live sequences, and the server stays SERVING."""

from __future__ import annotations

import string
import uuid
from collections import Counter
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from service.gen.model_executor.v1 import executor_pb2 as pb
from service.health import READINESS_SERVICE
from tests.system.reliability.budget import BUDGET
from tests.system.reliability.figures import Figures
from tests.system.reliability.support import ServerHarness, check_kv, tiny_config

VOCAB = 512
MAX_CONTEXT = 64
CONFIG = tiny_config(kv_tokens=256, max_sequences=6, max_context=MAX_CONTEXT,
                     max_prefill_tokens=128)
# What a client may get for any request; anything else (INTERNAL, UNKNOWN, ...) is a bug.
EXPECTED = {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED", "ABORTED"}
SEQ_POOL = ["a", "b", "c", "d", "e", "f", "g"]

seq_ids = st.one_of(st.sampled_from(SEQ_POOL), st.sampled_from(["", "x" * 257, "é" * 129]),
                    st.text(max_size=8))
token_ids = st.lists(st.one_of(st.integers(0, VOCAB - 1),
                               st.integers(-(2**31), 2**31 - 1)), max_size=24)
floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
sampling = st.one_of(st.none(), st.builds(
    lambda t, k, p, m, seed, lp, top: pb.SamplingParams(
        temperature=t, top_k=k, min_p=m, logprobs=lp, top_logprobs=top,
        **({} if p is None else {"top_p": p}), **({} if seed is None else {"seed": seed})),
    st.one_of(st.just(0.0), st.floats(0, 2, width=32), floats),
    st.integers(-3, 600), st.one_of(st.none(), floats), st.one_of(st.just(0.0), floats),
    st.one_of(st.none(), st.integers(0, 2**64 - 1)), st.booleans(), st.integers(-2, 25)))
request_ids = st.one_of(st.just(""), st.text(string.ascii_letters, min_size=1, max_size=3),
                        st.just("r" * 129))


def prefill_item(seq: str, tokens: list[int], sample: bool, params: Any) -> pb.PrefillItem:
    item = pb.PrefillItem(seq_id=seq, token_ids=tokens, sample=sample)
    if params is not None:
        item.sampling.CopyFrom(params)
    return item


def decode_item(seq: str, token: int, params: Any) -> pb.DecodeItem:
    item = pb.DecodeItem(seq_id=seq, token_id=token)
    if params is not None:
        item.sampling.CopyFrom(params)
    return item


prefill_items = st.lists(st.builds(prefill_item, seq_ids, token_ids, st.booleans(), sampling),
                         max_size=4)
# Mostly well-formed calls, so sequences live long enough for decode, extension, exhaustion.
valid_sampling = st.one_of(st.none(), st.builds(
    pb.SamplingParams, temperature=st.floats(0, 2, width=32), top_k=st.integers(0, 50),
    top_p=st.floats(0.0625, 1, width=32), seed=st.integers(0, 2**64 - 1),
    logprobs=st.booleans(), top_logprobs=st.integers(0, 20)))
valid_prefill_items = st.lists(st.builds(
    prefill_item, st.sampled_from(SEQ_POOL),
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=16), st.booleans(),
    valid_sampling), min_size=1, max_size=3, unique_by=lambda item: item.seq_id)
decode_items = st.lists(st.builds(decode_item, seq_ids,
                                  st.one_of(st.integers(0, VOCAB - 1),
                                            st.integers(-(2**31), 2**31 - 1)), sampling),
                        max_size=4)


def test_random_call_sequences(server: ServerHarness, figures: Figures) -> None:
    codes: Counter[str] = Counter()

    class Scheduler(RuleBasedStateMachine):
        """Random calls; a model of each live sequence's length, checked after each."""

        def __init__(self) -> None:
            super().__init__()
            self.lengths: dict[str, int] = {}
            self.answered: list[tuple[str, Any, pb.PrefillResponse]] = []  # retry candidates
            self.calls = 0
            # The server's retry cache outlives an example: ids from one example must never
            # meet another's, or replays (shrinking) see different answers and hypothesis
            # reports the strategy as flaky.
            self.nonce = uuid.uuid4().hex[:8]

        def call(self, method: str, request: Any) -> Any:
            self.calls += 1
            try:
                response = getattr(server.stub, method)(request, timeout=BUDGET.call_timeout_s)
                codes["OK"] += 1
                return response
            except grpc.RpcError as err:
                codes[err.code().name] += 1
                assert err.code().name in EXPECTED, (method, request, err.details())
                return None

        def rid(self, request_id: str) -> str:
            """Per-example ids: ``u`` a fresh id per call, others as drawn (reused within
            the example on purpose), empty stays empty (not idempotent)."""
            if not request_id:
                return ""
            if request_id == "u":
                return f"{self.nonce}-u-{self.calls}"
            return f"{self.nonce}-{request_id}"

        @rule(items=valid_prefill_items, request_id=st.sampled_from(["", "u"]))
        def prefill_valid(self, items: list[pb.PrefillItem], request_id: str) -> None:
            self.prefill(items, request_id)

        @rule(data=st.data(), request_id=st.sampled_from(["", "u"]))
        def decode_live(self, data: st.DataObject, request_id: str) -> None:
            if self.lengths:
                seqs = data.draw(st.lists(st.sampled_from(sorted(self.lengths)), min_size=1,
                                          max_size=3, unique=True))
                items = [decode_item(s, data.draw(st.integers(0, VOCAB - 1)),
                                     data.draw(valid_sampling)) for s in seqs]
                self.decode(items, request_id)

        @rule(items=prefill_items, request_id=request_ids)
        def prefill(self, items: list[pb.PrefillItem], request_id: str) -> None:
            request = pb.PrefillRequest(request_id=self.rid(request_id), items=items)
            response = self.call("Prefill", request)
            if response is not None and not self._replay(request, response):
                for item, out in zip(items, response.outputs, strict=True):
                    assert out.seq_len == self.lengths.get(item.seq_id, 0) + len(item.token_ids)
                    self.lengths[item.seq_id] = out.seq_len
                    assert out.HasField("token_id") == item.sample
                self.answered.append(("Prefill", request, response))

        @rule(items=decode_items, request_id=request_ids)
        def decode(self, items: list[pb.DecodeItem], request_id: str) -> None:
            request = pb.DecodeRequest(request_id=self.rid(request_id), items=items)
            response = self.call("Decode", request)
            if response is not None and not self._replay(request, response):
                for item, out in zip(items, response.outputs, strict=True):
                    assert out.seq_len == self.lengths[item.seq_id] + 1
                    self.lengths[item.seq_id] = out.seq_len
                    assert 0 <= out.token_id < VOCAB
                self.answered.append(("Decode", request, response))

        @rule(seqs=st.lists(seq_ids, max_size=3))
        def release(self, seqs: list[str]) -> None:
            response = self.call("Release", pb.ReleaseRequest(seq_ids=seqs))
            if response is not None:
                known = [s for s in dict.fromkeys(seqs) if s in self.lengths]
                assert response.released == len(known)
                for s in known:
                    del self.lengths[s]

        @rule(data=st.data())
        def retry(self, data: st.DataObject) -> None:
            """A retry of an earlier successful call: the same response, nothing applied."""
            candidates = [a for a in self.answered if a[1].request_id]
            if not candidates:
                return
            method, request, original = data.draw(st.sampled_from(candidates))
            response = self.call(method, request)
            assert response is None or response == original  # ABORTED once dropped

        def _replay(self, request: Any, response: pb.PrefillResponse) -> bool:
            """True if ``response`` answered an earlier call with the same request_id."""
            return any(r.request_id and r.request_id == request.request_id and o == response
                       for _, r, o in self.answered)

        @rule()
        def health(self) -> None:
            assert server.check(READINESS_SERVICE) == 1

        @invariant()
        def accounting(self) -> None:
            stats = check_kv(server, figures)
            assert stats.active_sequences == len(self.lengths)
            assert stats.total_tokens - stats.free_tokens == sum(self.lengths.values())

        def teardown(self) -> None:
            if self.lengths:
                server.stub.Release(pb.ReleaseRequest(seq_ids=list(self.lengths)), timeout=10)

    run_state_machine_as_test(Scheduler, settings=settings(
        max_examples=BUDGET.fuzz_examples, stateful_step_count=BUDGET.fuzz_steps,
        deadline=None, suppress_health_check=list(HealthCheck)))
    assert codes["OK"] > 0 and codes["INVALID_ARGUMENT"] > 0
    figures.notes["fuzz_sequence_codes"] = dict(sorted(codes.items()))
    assert server.check(READINESS_SERVICE) == 1


# -- bytes that are not the method's message --------------------------------------------

UNARY_METHODS = ["/model_executor.v1.Executor/Prefill", "/model_executor.v1.Executor/Decode",
                 "/model_executor.v1.Executor/Release", "/model_executor.v1.Executor/Capture",
                 "/model_executor.v1.Executor/Health", "/grpc.health.v1.Health/Check"]
VALID = pb.PrefillRequest(request_id="m", items=[
    pb.PrefillItem(seq_id="m", token_ids=[1, 2, 3], sample=True)]).SerializeToString()


def _mutate(data: bytes, flips: list[tuple[int, int]], cut: int) -> bytes:
    out = bytearray(data)
    for position, value in flips:
        out[position % len(out)] = value
    return bytes(out[: max(0, len(out) - cut)])


raw = st.one_of(
    st.binary(max_size=64),
    st.builds(_mutate, st.just(VALID), st.lists(st.tuples(st.integers(0, 10**6),
                                                          st.integers(0, 255)), max_size=3),
              st.integers(0, 8)),
    st.sampled_from([b"\xff\xff\xff", b"\x0a\x03\xff\xfe\xfd", b"\x12\x05\x0a\x01a\x10",
                     b"\x08" * 11, b"\x12\xff\xff\xff\xff\x0f"]))


def test_malformed_bytes_at_every_method(server: ServerHarness, figures: Figures) -> None:
    channel = server.channel
    codes: Counter[str] = Counter()
    baseline = check_kv(server, figures)

    @settings(max_examples=BUDGET.malformed_per_method, deadline=None,
              suppress_health_check=list(HealthCheck), database=None)
    @given(data=raw)
    def send(method: str, data: bytes) -> None:
        try:
            channel.unary_unary(method)(data, timeout=BUDGET.call_timeout_s)
            codes["OK"] += 1
        except grpc.RpcError as err:
            codes[err.code().name] += 1
            # FAILED_PRECONDITION: a Capture that parsed (no graphs on CPU)
            assert err.code().name in EXPECTED | {"FAILED_PRECONDITION"}, (method, data, err)

    for method in UNARY_METHODS:
        send(method)
    # the streaming methods: Health/Watch (one request) and reflection (a request stream)
    watch = channel.unary_stream("/grpc.health.v1.Health/Watch")
    reflect = channel.stream_stream(
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
    for data in (b"\xff\xff\xff", b"\x0a\x03\xff\xfe\xfd"):
        for call in (lambda d=data: next(iter(watch(d, timeout=5))),
                     lambda d=data: list(reflect(iter([d]), timeout=5))):
            with pytest.raises(grpc.RpcError) as info:
                call()
            codes[info.value.code().name] += 1
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    assert codes["INVALID_ARGUMENT"] > 0
    # whatever parsed and ran is released; the server is as before and still serving
    server.stub.Release(pb.ReleaseRequest(seq_ids=["m", *SEQ_POOL]), timeout=10)
    stats = check_kv(server, figures)
    if stats != baseline:  # random bytes that parsed as a Prefill of other sequences
        assert stats.active_sequences > baseline.active_sequences
    assert server.check(READINESS_SERVICE) == 1
    figures.notes["malformed_codes"] = dict(sorted(codes.items()))
