"""The Session stream over a real channel: pipelined steps against unary calls, failure
and acknowledgement, multi-step decode, a protocol error, a device failure found at
completion, and a stream cancelled mid-pipeline (what applied, and how a retry learns it)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from executor.steps import PendingStep
from service.gen.model_executor.v1 import executor_pb2 as pb
from tests.service.harness import ServerHarness

SEEDED = pb.SamplingParams(temperature=0.8, seed=3, logprobs=True, top_logprobs=2)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def prefill(seq_id: str, tokens: list[int], request_id: str = "") -> pb.PrefillRequest:
    return pb.PrefillRequest(request_id=request_id, items=[
        pb.PrefillItem(seq_id=seq_id, token_ids=tokens, sample=True, sampling=SEEDED)])


def decode_last(seq_ids: list[str], num_steps: int = 0, request_id: str = ""
                ) -> pb.DecodeRequest:
    return pb.DecodeRequest(request_id=request_id, num_steps=num_steps, items=[
        pb.DecodeItem(seq_id=s, use_last_sampled=True, sampling=SEEDED) for s in seq_ids])


def unary_reference(server: ServerHarness, seq_id: str, tokens: list[int], decodes: int = 3
                    ) -> list[Any]:
    """A Prefill and ``decodes`` seeded Decodes of one sequence, over unary calls (it is
    released after): what the same steps over a Session must give."""
    ref = [server.stub.Prefill(prefill(seq_id, tokens), timeout=30)]
    for _ in range(decodes):
        ref.append(server.stub.Decode(pb.DecodeRequest(items=[pb.DecodeItem(
            seq_id=seq_id, token_id=ref[-1].outputs[0].token_id, sampling=SEEDED)]),
            timeout=30))
    server.stub.Release(pb.ReleaseRequest(seq_ids=[seq_id]), timeout=30)
    return ref


def tokens_of(response: Any) -> list[tuple[str, int, int, tuple[int, ...]]]:
    return [(o.seq_id[1:], o.token_id, o.seq_len, tuple(s.token_id for s in o.steps))
            for o in response.outputs]


def assert_exact(harness: ServerHarness) -> None:
    kv = harness.kv()
    ex: Any = harness.executor
    assert kv.free_tokens + sum(ex.kv.get(s).length for s in list(ex.kv._seqs)) \
        == kv.total_tokens
    harness.call(_noop())  # let the loop settle
    ex.kv.check_invariants()


async def _noop() -> None:
    return None


def test_pipelined_session_equals_unary_calls(server: ServerHarness) -> None:
    """All requests sent at once (the server keeps two steps in flight), decode items
    continuing from the device's last samples, a multi-step decode and a release among
    them: the same tokens as unary calls given explicit tokens."""
    before = server.kv()
    # Unary reference on sequences "u*".
    ref: list[Any] = [server.stub.Prefill(prefill("ua", prompt(1, 9)), timeout=30),
                      server.stub.Prefill(prefill("ub", prompt(2, 5)), timeout=30)]
    last = {"ua": ref[0].outputs[0].token_id, "ub": ref[1].outputs[0].token_id}
    for k in (1, 1, 3, 1):
        r = server.stub.Decode(pb.DecodeRequest(num_steps=k, items=[
            pb.DecodeItem(seq_id=s, token_id=t, sampling=SEEDED) for s, t in last.items()]),
            timeout=30)
        ref.append(r)
        last = {o.seq_id: o.token_id for o in r.outputs}
    ref.append(server.stub.Release(pb.ReleaseRequest(seq_ids=["ub"]), timeout=30))
    r = server.stub.Decode(pb.DecodeRequest(items=[
        pb.DecodeItem(seq_id="ua", token_id=last["ua"], sampling=SEEDED)]), timeout=30)
    ref.append(r)
    server.stub.Release(pb.ReleaseRequest(seq_ids=["ua"]), timeout=30)

    ops: list[dict[str, Any]] = [
        {"prefill": prefill("sa", prompt(1, 9))}, {"prefill": prefill("sb", prompt(2, 5))},
        {"decode": decode_last(["sa", "sb"])}, {"decode": decode_last(["sa", "sb"])},
        {"decode": decode_last(["sa", "sb"], num_steps=3)},
        {"decode": decode_last(["sa", "sb"])},
        {"release": pb.ReleaseRequest(seq_ids=["sb"])}, {"decode": decode_last(["sa"])}]
    requests = [pb.SessionRequest(step=10 + 2 * i, **op) for i, op in enumerate(ops)]
    responses = list(server.stub.Session(iter(requests), timeout=60))
    assert [r.step for r in responses] == [q.step for q in requests]
    for got, want in zip(responses, ref, strict=True):
        kind = got.WhichOneof("result")
        assert kind != "error", got.error
        if kind == "release":
            assert got.release.released == want.released == 1
        else:
            assert tokens_of(getattr(got, kind)) == tokens_of(want)
    assert responses[4].decode.step.num_steps == 3
    server.stub.Release(pb.ReleaseRequest(seq_ids=["sa"]), timeout=30)
    assert server.kv() == before


def test_a_failed_step_aborts_later_steps_until_acknowledged(server: ServerHarness) -> None:
    before = server.kv()
    requests = [
        pb.SessionRequest(step=1, prefill=prefill("fa", prompt(5, 6))),
        pb.SessionRequest(step=2, decode=decode_last(["fa", "nope"])),  # NOT_FOUND
        pb.SessionRequest(step=3, decode=decode_last(["fa"])),
        pb.SessionRequest(step=4, decode=decode_last(["fa"]), ack_failed_step=1),  # wrong ack
        pb.SessionRequest(step=5, decode=decode_last(["fa"]), ack_failed_step=2),
        pb.SessionRequest(step=6, release=pb.ReleaseRequest(seq_ids=["fa"])),
    ]
    responses = list(server.stub.Session(iter(requests), timeout=60))
    kinds = [r.WhichOneof("result") for r in responses]
    assert kinds == ["prefill", "error", "error", "error", "decode", "release"]
    assert responses[1].error.code_name == "NOT_FOUND"
    assert "nope" in responses[1].error.message
    for r in responses[2:4]:
        assert r.error.code_name == "ABORTED" and "ack_failed_step=2" in r.error.message
    # Steps 2-4 applied nothing: step 5 is the sequence's first decode.
    assert responses[4].decode.outputs[0].seq_len == 6 + 1
    assert server.kv() == before
    assert_exact(server)


def test_protocol_errors_end_the_stream_after_earlier_answers(server: ServerHarness) -> None:
    requests = [pb.SessionRequest(step=5, prefill=prefill("pa", prompt(6, 3))),
                pb.SessionRequest(step=5, release=pb.ReleaseRequest(seq_ids=["pa"]))]
    call = server.stub.Session(iter(requests), timeout=30)
    first = next(call)
    assert first.WhichOneof("result") == "prefill"
    with pytest.raises(grpc.RpcError) as info:
        next(call)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not greater than the previous step 5" in str(info.value.details())
    server.stub.Release(pb.ReleaseRequest(seq_ids=["pa"]), timeout=30)
    assert_exact(server)


def test_multi_step_decode_over_unary_equals_single_steps(server: ServerHarness) -> None:
    one = server.stub.Prefill(prefill("m1", prompt(8, 7)), timeout=30).outputs[0].token_id
    server.stub.Prefill(prefill("m2", prompt(8, 7)), timeout=30)
    singles = []
    for _ in range(5):
        out = server.stub.Decode(pb.DecodeRequest(items=[
            pb.DecodeItem(seq_id="m1", token_id=one, sampling=SEEDED)]), timeout=30).outputs[0]
        singles.append((out.token_id, round(out.logprob, 5)))
        one = out.token_id
    multi = server.stub.Decode(decode_last(["m2"], num_steps=5), timeout=30)
    out = multi.outputs[0]
    assert [(s.token_id, round(s.logprob, 5)) for s in out.steps] == singles
    assert out.token_id == singles[-1][0] and out.seq_len == 7 + 5
    assert multi.step.num_steps == 5 and multi.step.num_tokens == 5
    server.stub.Release(pb.ReleaseRequest(seq_ids=["m1", "m2"]), timeout=30)


def test_a_device_failure_at_completion_rolls_back_later_steps(server: ServerHarness) -> None:
    """Step 3's completion fails (an injected device fault): steps launched after it are
    rolled back newest first and answered ABORTED, step 3 with the fault's status; what
    applied before stays applied, and the accounting is exact."""
    ex: Any = harness_executor(server)
    real_launch = ex.launch_decode
    calls = {"n": 0}

    def launch(items: Any, num_steps: int = 1) -> PendingStep:
        pending: PendingStep = real_launch(items, num_steps)
        calls["n"] += 1
        if calls["n"] == 2:
            def fail() -> Any:
                raise RuntimeError("injected device fault")
            pending.finish = fail  # type: ignore[method-assign]
        return pending

    ex.launch_decode = launch
    gate = threading.Event()

    def requests() -> Iterator[pb.SessionRequest]:
        yield pb.SessionRequest(step=1, prefill=prefill("da", prompt(9, 4)))
        yield pb.SessionRequest(step=2, decode=decode_last(["da"]))
        yield pb.SessionRequest(step=3, decode=decode_last(["da"]))  # fails at completion
        yield pb.SessionRequest(step=4, decode=decode_last(["da"]))
        gate.wait(10)
        yield pb.SessionRequest(step=5, decode=pb.DecodeRequest(items=[
            pb.DecodeItem(seq_id="da", token_id=7)]), ack_failed_step=3)
        yield pb.SessionRequest(step=6, release=pb.ReleaseRequest(seq_ids=["da"]))

    try:
        responses = []
        for r in server.stub.Session(requests(), timeout=60):
            responses.append(r)
            if r.step == 4:
                gate.set()
    finally:
        ex.launch_decode = real_launch
    kinds = [(r.step, r.WhichOneof("result")) for r in responses]
    assert kinds == [(1, "prefill"), (2, "decode"), (3, "error"), (4, "error"), (5, "decode"),
                     (6, "release")]
    assert responses[2].error.code_name == "INTERNAL"
    assert responses[3].error.code_name == "ABORTED"
    # Only steps 1 and 2 applied before step 5: 4 prompt tokens + 1 + 1.
    assert responses[4].decode.outputs[0].seq_len == 4 + 1 + 1
    assert_exact(server)


def harness_executor(harness: ServerHarness) -> Any:
    return harness.executor


def test_a_cancelled_stream_lets_launched_steps_apply_and_retries_learn_it(
        server: ServerHarness) -> None:
    """The client cancels after the first answer. Every step the server launched still
    applies (and nothing else); resending each step's request_id as a unary call returns
    the stored response of a step that applied and runs one that did not."""
    before = server.kv()
    ids = [f"cx-{i}" for i in range(6)]
    requests = [pb.SessionRequest(step=1, prefill=prefill("ca", prompt(11, 5), ids[0]))]
    requests += [pb.SessionRequest(step=2 + i, decode=decode_last(["ca"], request_id=ids[1 + i]))
                 for i in range(5)]
    call = server.stub.Session(iter(requests), timeout=60)
    first = next(call)
    assert first.WhichOneof("result") == "prefill"
    call.cancel()
    # The launched steps finish in the background; then the length says how many applied.
    ex: Any = server.executor

    def settled() -> int:
        return int(ex.kv.get("ca").length)

    deadline = time.monotonic() + 10
    length = settled()
    while time.monotonic() < deadline:
        time.sleep(0.2)
        if settled() == length and not server.server.worker.pending:
            break
        length = settled()
    applied = length - 5  # decodes that applied
    assert 0 <= applied <= 5
    # Resend every decode by request_id, unary: applied ones replay, others run now.
    tokens = []
    for i in range(5):
        response = server.stub.Decode(decode_last(["ca"], request_id=ids[1 + i]), timeout=30)
        out = response.outputs[0]
        assert out.seq_len == 5 + 1 + i  # each step exactly once, in order
        tokens.append(out.token_id)
    assert settled() == 10
    server.stub.Release(pb.ReleaseRequest(seq_ids=["ca"]), timeout=30)
    assert server.kv() == before
    assert_exact(server)


def test_a_stream_ended_mid_launch_lets_that_launch_apply(server: ServerHarness) -> None:
    """The client cancels while the server's reader is inside a step's launch (held on the
    executor thread): the launch is not cancelled, the step applies once, and its stored
    response answers a unary retry of its request_id."""
    ex: Any = harness_executor(server)
    real_launch = ex.launch_decode
    entered, go, hold = threading.Event(), threading.Event(), threading.Event()

    def launch(items: Any, num_steps: int = 1) -> PendingStep:
        entered.set()
        go.wait(10)
        pending: PendingStep = real_launch(items, num_steps)
        return pending

    def requests() -> Iterator[pb.SessionRequest]:
        yield pb.SessionRequest(step=1, prefill=prefill("ml", prompt(14, 5)))
        yield pb.SessionRequest(step=2, decode=decode_last(["ml"], request_id="ml-2"))
        hold.wait(10)  # the stream stays open until cancelled

    ex.launch_decode = launch
    try:
        call = server.stub.Session(requests(), timeout=60)
        assert next(call).WhichOneof("result") == "prefill"
        assert entered.wait(10)
        call.cancel()
        time.sleep(0.3)  # the server sees the stream end while the launch is held
        go.set()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (server.server.worker.pending
                                               or ex.kv.get("ml").length != 6):
            time.sleep(0.05)
    finally:
        ex.launch_decode = real_launch
        go.set()
        hold.set()
    assert ex.kv.get("ml").length == 6  # the decode applied
    retry = server.stub.Decode(decode_last(["ml"], request_id="ml-2"), timeout=30)
    assert retry.outputs[0].seq_len == 6  # answered by the stored response, not run again
    assert ex.kv.get("ml").length == 6
    server.stub.Release(pb.ReleaseRequest(seq_ids=["ml"]), timeout=30)
    assert_exact(server)


def test_session_steps_are_counted_like_unary_ones(server: ServerHarness) -> None:
    """Step metrics stay exact on the stream (recorded after each answer is sent)."""
    def tokens() -> float:
        return sum(v for (name, labels), v in server.scrape().items()
                   if name == "model_executor_tokens_total" and ("phase", "decode") in labels)

    before = tokens()
    requests = [pb.SessionRequest(step=1, prefill=prefill("mt", prompt(12, 4))),
                pb.SessionRequest(step=2, decode=decode_last(["mt"])),
                pb.SessionRequest(step=3, decode=decode_last(["mt"], num_steps=3)),
                pb.SessionRequest(step=4, release=pb.ReleaseRequest(seq_ids=["mt"]))]
    responses = list(server.stub.Session(iter(requests), timeout=30))
    assert [r.WhichOneof("result") for r in responses] == ["prefill", "decode", "decode",
                                                          "release"]
    assert tokens() - before == 1 + 3


def test_speculative_roll_back_inside_a_session(server: ServerHarness) -> None:
    """Prefill a draft, truncate the rejected tail and continue, all on one stream: the
    truncate applies after the steps before it and the decode after it sees the shorter
    sequence."""
    before = server.kv()
    draft = pb.PrefillRequest(items=[pb.PrefillItem(seq_id="sp", token_ids=[7, 8, 9, 10],
                                                    sample=False)])
    requests = [pb.SessionRequest(step=1, prefill=prefill("sp", prompt(13, 5))),
                pb.SessionRequest(step=2, prefill=draft),
                pb.SessionRequest(step=3, truncate=pb.TruncateRequest(seq_id="sp", length=6)),
                pb.SessionRequest(step=4, decode=pb.DecodeRequest(items=[
                    pb.DecodeItem(seq_id="sp", token_id=8)])),
                pb.SessionRequest(step=5, truncate=pb.TruncateRequest(seq_id="nope")),
                pb.SessionRequest(step=6, release=pb.ReleaseRequest(seq_ids=["sp"]),
                                  ack_failed_step=5)]
    responses = list(server.stub.Session(iter(requests), timeout=30))
    kinds = [r.WhichOneof("result") for r in responses]
    assert kinds == ["prefill", "prefill", "truncate", "decode", "error", "release"]
    assert (responses[2].truncate.seq_len, responses[2].truncate.freed_tokens) == (6, 3)
    assert responses[3].decode.outputs[0].seq_len == 7
    assert responses[4].error.code_name == "NOT_FOUND"
    assert server.kv() == before


def test_an_unchanged_decode_request_is_converted_once(server: ServerHarness,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A pipelined loop sends the same decode request every step: the stream converts it
    once and reuses the items while it stays equal; each step still applies on its own."""
    from service import convert

    converted: list[int] = []
    real = convert.decode_items

    def counting(request: pb.DecodeRequest, limits: Any) -> Any:
        converted.append(len(request.items))
        return real(request, limits)

    monkeypatch.setattr(convert, "decode_items", counting)
    before = server.kv()
    same = decode_last(["ra", "rb"])
    requests = [pb.SessionRequest(step=1, prefill=prefill("ra", prompt(11, 4))),
                pb.SessionRequest(step=2, prefill=prefill("rb", prompt(12, 6))),
                *(pb.SessionRequest(step=3 + i, decode=same) for i in range(3)),
                pb.SessionRequest(step=6, decode=decode_last(["rb"])),
                pb.SessionRequest(step=7, decode=same),
                pb.SessionRequest(step=8, release=pb.ReleaseRequest(seq_ids=["ra", "rb"]))]
    responses = list(server.stub.Session(iter(requests), timeout=60))
    assert [r.WhichOneof("result") for r in responses] == \
        ["prefill", "prefill", "decode", "decode", "decode", "decode", "decode", "release"]
    assert converted == [2, 1, 2]  # the repeats reused the first conversion
    lens = [[o.seq_len for o in r.decode.outputs] for r in responses[2:7]]
    assert lens == [[5, 7], [6, 8], [7, 9], [10], [8, 11]]
    assert server.kv() == before
    assert_exact(server)


class _LaterEvent:
    """A device event that fires a few milliseconds after launch (as a CUDA step's does):
    the Session then waits for the step on its completion threads, not on the loop."""

    def __init__(self, delay_s: float) -> None:
        self.ready_at = time.perf_counter() + delay_s

    def query(self) -> bool:
        return time.perf_counter() >= self.ready_at

    def synchronize(self) -> None:
        while (left := self.ready_at - time.perf_counter()) > 0:
            time.sleep(left)


def test_steps_with_a_device_event_complete_on_the_completion_threads(
        server: ServerHarness) -> None:
    """The CUDA path of a Session step (its completion waits for a device event), on CPU:
    pipelined steps give the tokens of unary calls through the servicer's completion
    threads; a completion that raises there answers INTERNAL and aborts the steps after
    it, nothing of them applied, and the accounting stays exact. Step 4's launch may find step 3's
    failure on the executor thread: step 3 must stay the step to acknowledge (before the
    fix in ``SessionStream._launch`` it became step 4, so step 5's ack of 3 was refused:
    2 runs in 5 failed)."""
    ex: Any = harness_executor(server)
    real = ex.launch_decode, ex.launch_prefill
    fail_at: list[int] = []
    calls = {"n": 0}

    def evented(launch: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> PendingStep:
            pending: PendingStep = launch(*args, **kwargs)
            pending.done = _LaterEvent(0.003)  # type: ignore[assignment]
            calls["n"] += 1
            if calls["n"] in fail_at:
                def fail() -> Any:
                    pending.wait()
                    raise RuntimeError("injected device fault")
                pending.finish = fail  # type: ignore[method-assign]
            return pending
        return wrapped

    ex.launch_decode, ex.launch_prefill = evented(real[0]), evented(real[1])
    before = server.kv()
    completions = server.server.servicer.sessions.completions
    threads = completions.threads
    try:
        ref = unary_reference(server, "ra", prompt(21, 7))
        requests = [pb.SessionRequest(step=1, prefill=prefill("pa", prompt(21, 7)))]
        requests += [pb.SessionRequest(step=2 + i, decode=decode_last(["pa"]))
                     for i in range(3)]
        responses = list(server.stub.Session(iter(requests), timeout=60))
        assert [tokens_of(getattr(r, r.WhichOneof("result"))) for r in responses] == \
            [tokens_of(r) for r in ref]
        assert completions.threads > threads or completions.threads > 0
        server.stub.Release(pb.ReleaseRequest(seq_ids=["pa"]), timeout=30)

        calls["n"], fail_at[:] = 0, [3]  # the third launch: step 3 below
        gate = threading.Event()

        def failing() -> Iterator[pb.SessionRequest]:
            yield pb.SessionRequest(step=1, prefill=prefill("ec", prompt(22, 4)))
            yield pb.SessionRequest(step=2, decode=decode_last(["ec"]))
            yield pb.SessionRequest(step=3, decode=decode_last(["ec"]))  # fails
            yield pb.SessionRequest(step=4, decode=decode_last(["ec"]))
            gate.wait(10)
            yield pb.SessionRequest(step=5, release=pb.ReleaseRequest(seq_ids=["ec"]),
                                    ack_failed_step=3)

        got = []
        for r in server.stub.Session(failing(), timeout=60):
            got.append(r)
            if r.step == 4:
                gate.set()
    finally:
        ex.launch_decode, ex.launch_prefill = real
    assert [(r.step, r.WhichOneof("result")) for r in got] == [
        (1, "prefill"), (2, "decode"), (3, "error"), (4, "error"), (5, "release")], \
        [r.error.message for r in got]
    assert (got[2].error.code_name, got[3].error.code_name) == ("INTERNAL", "ABORTED")
    assert server.kv() == before
    assert_exact(server)


class _HeldEvent:
    """A device event that fires when the test says so: a step launched, its completion
    held (as a CUDA step still on the device)."""

    def __init__(self, fired: threading.Event) -> None:
        self.fired = fired

    def query(self) -> bool:
        return self.fired.is_set()

    def synchronize(self) -> None:
        assert self.fired.wait(30), "the held step was never let complete"


def test_health_shows_the_sequence_table_after_a_late_completion(
        server: ServerHarness) -> None:
    """A Session cut short while its steps are launched but not complete, then a Release
    of its sequence: the launched steps complete afterwards (in the gone stream's drain)
    and must not publish the KV accounting of their launch over the Release's. Health and
    the gauges agree with the executor's table (before the fix: active_sequences 1 and the
    prompt's tokens used, until another call changed KV)."""
    ex: Any = harness_executor(server)
    real = ex.launch_decode, ex.launch_prefill
    fired = threading.Event()

    def held(launch: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> PendingStep:
            pending: PendingStep = launch(*args, **kwargs)
            pending.done = _HeldEvent(fired)  # type: ignore[assignment]
            return pending
        return wrapped

    hold = threading.Event()

    def requests() -> Iterator[pb.SessionRequest]:
        yield pb.SessionRequest(step=1, prefill=prefill("lt", prompt(31, 40), "lt-1"))
        yield pb.SessionRequest(step=2, decode=decode_last(["lt"], request_id="lt-2"))
        hold.wait(10)

    before = server.kv()
    ex.launch_decode, ex.launch_prefill = held(real[0]), held(real[1])
    try:
        call = server.stub.Session(requests(), timeout=60)
        deadline = time.monotonic() + 10
        while ex.kv.get("lt") is None or ex.kv.get("lt").length != 41:  # both launched
            assert time.monotonic() < deadline, ("the steps were not launched", ex.kv.get("lt"))
            time.sleep(0.01)
        call.cancel()  # the client's deadline, cut short: the steps are still on the device
        drains = server.server.servicer.sessions.draining
        deadline = time.monotonic() + 10
        while not drains:
            assert time.monotonic() < deadline, "the stream's drain did not start"
            time.sleep(0.01)
        released = server.stub.Release(pb.ReleaseRequest(seq_ids=["lt"]), timeout=10)
        assert released.released == 1
        fired.set()  # the launched steps complete now, after the Release
        deadline = time.monotonic() + 10
        while drains or server.server.worker.pending:
            assert time.monotonic() < deadline, "the drain did not finish"
            time.sleep(0.01)
        server.call(_noop())
    finally:
        fired.set()
        hold.set()
        ex.launch_decode, ex.launch_prefill = real
    kv = server.kv()
    assert kv.active_sequences == len(ex.kv._seqs) == before.active_sequences
    assert kv == before
    gauges = server.scrape()
    assert gauges[("model_executor_active_sequences", ())] == kv.active_sequences
    assert gauges[("model_executor_kv_tokens", (("state", "free"),))] == kv.free_tokens
    assert_exact(server)


def test_a_stream_cancelled_while_a_completion_is_awaited_keeps_its_launched_steps(
        server: ServerHarness) -> None:
    """The client cancels while the server waits for a launched step's completion (the
    CUDA path): the steps launched still apply, complete in the drain and answer retries
    of their request_ids from the retry cache (before, the cancellation was taken for a
    device failure: both steps were rolled back and the first answered INTERNAL)."""
    ex: Any = harness_executor(server)
    real = ex.launch_decode, ex.launch_prefill
    fired, hold = threading.Event(), threading.Event()

    def held(launch: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> PendingStep:
            pending: PendingStep = launch(*args, **kwargs)
            pending.done = _HeldEvent(fired)  # type: ignore[assignment]
            return pending
        return wrapped

    def requests() -> Iterator[pb.SessionRequest]:
        yield pb.SessionRequest(step=1, prefill=prefill("kc", prompt(32, 6), "kc-1"))
        yield pb.SessionRequest(step=2, decode=decode_last(["kc"], request_id="kc-2"))
        hold.wait(10)

    ex.launch_decode, ex.launch_prefill = held(real[0]), held(real[1])
    try:
        call = server.stub.Session(requests(), timeout=60)
        deadline = time.monotonic() + 10
        while ex.kv.get("kc") is None or ex.kv.get("kc").length != 7:
            assert time.monotonic() < deadline, "the steps were not launched"
            time.sleep(0.01)
        call.cancel()
        time.sleep(0.2)  # the server sees the cancel while it waits for step 1
        fired.set()
        drains = server.server.servicer.sessions.draining
        deadline = time.monotonic() + 10
        while drains or server.server.worker.pending:
            assert time.monotonic() < deadline, "the drain did not finish"
            time.sleep(0.01)
    finally:
        fired.set()
        hold.set()
        ex.launch_decode, ex.launch_prefill = real
    assert ex.kv.get("kc").length == 7  # both applied, neither rolled back
    first = server.stub.Prefill(prefill("kc", prompt(32, 6), "kc-1"), timeout=10)
    second = server.stub.Decode(decode_last(["kc"], request_id="kc-2"), timeout=10)
    assert (first.outputs[0].seq_len, second.outputs[0].seq_len) == (6, 7)  # replayed
    assert ex.kv.get("kc").length == 7
    server.stub.Release(pb.ReleaseRequest(seq_ids=["kc"]), timeout=10)
    assert_exact(server)


class _DoneEvent:
    """A device event that has fired already (a host-bound pipeline's oldest step): its
    waits are recorded by thread."""

    def __init__(self, waited_on: list[str]) -> None:
        self.waited_on = waited_on

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.waited_on.append(threading.current_thread().name)


def test_a_step_whose_device_work_is_done_completes_without_a_thread_hop(
        server: ServerHarness) -> None:
    """A launched step whose event has fired when the writer reaches it is completed on
    the loop, not handed to a completion thread and back; its answers are the unary
    calls' (before, every step with an event went through the threads)."""
    ex: Any = harness_executor(server)
    real = ex.launch_decode, ex.launch_prefill
    waited_on: list[str] = []

    def done(launch: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> PendingStep:
            pending: PendingStep = launch(*args, **kwargs)
            pending.done = _DoneEvent(waited_on)  # type: ignore[assignment]
            return pending
        return wrapped

    ref = unary_reference(server, "ya", prompt(41, 6))
    ex.launch_decode, ex.launch_prefill = done(real[0]), done(real[1])
    try:
        requests = [pb.SessionRequest(step=1, prefill=prefill("za", prompt(41, 6)))]
        requests += [pb.SessionRequest(step=2 + i, decode=decode_last(["za"]))
                     for i in range(3)]
        responses = list(server.stub.Session(iter(requests), timeout=60))
    finally:
        ex.launch_decode, ex.launch_prefill = real
    assert [tokens_of(getattr(r, r.WhichOneof("result"))) for r in responses] == \
        [tokens_of(r) for r in ref]
    assert len(waited_on) == 4
    assert not [name for name in waited_on if name.startswith("session_complete")], waited_on
    server.stub.Release(pb.ReleaseRequest(seq_ids=["za"]), timeout=30)
    assert_exact(server)
