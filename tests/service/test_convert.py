"""Proto -> executor conversion: limits and sampling-parameter ranges become field
violations with the path the client sent; valid params convert to the executor's."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from executor.api import (
    GREEDY,
    MAX_TOP_LOGPROBS,
    PhaseCapture,
    RankTiming,
    SamplingParams,
    StepInfo,
)
from executor.errors import InvalidRequest
from service import convert
from service.config import RequestLimits
from service.gen.model_executor.v1 import executor_pb2 as pb
from tests.service.harness import tiny_config

LIMITS = RequestLimits.from_executor(tiny_config(max_sequences=4, max_prefill_tokens=64))


def violations(fn: object, *args: object) -> dict[str, str]:
    with pytest.raises(InvalidRequest) as info:
        fn(*args)  # type: ignore[operator]
    return {v.field: v.description for v in info.value.violations}


def prefill(*items: pb.PrefillItem, request_id: str = "") -> pb.PrefillRequest:
    return pb.PrefillRequest(request_id=request_id, items=items)


def test_unset_sampling_is_greedy_and_fields_map_one_to_one() -> None:
    items = convert.prefill_items(prefill(pb.PrefillItem(seq_id="a", token_ids=[1, 2])), LIMITS)
    assert items[0].sampling == GREEDY and items[0].sample is False
    msg = pb.SamplingParams(temperature=0.5, top_k=7, top_p=0.25, min_p=0.125, seed=2**64 - 1,
                            logprobs=True, top_logprobs=3)
    item = pb.DecodeItem(seq_id="a", token_id=3, sampling=msg)
    [decoded] = convert.decode_items(pb.DecodeRequest(items=[item]), LIMITS)
    assert decoded.sampling == SamplingParams(0.5, 7, 0.25, 0.125, 2**64 - 1, True, 3)
    # top_p unset means off (1.0), not 0
    [decoded] = convert.decode_items(pb.DecodeRequest(items=[pb.DecodeItem(
        seq_id="a", sampling=pb.SamplingParams(temperature=1.0))]), LIMITS)
    assert decoded.sampling.top_p == 1.0 and decoded.sampling.seed is None


finite = st.floats(width=32, allow_nan=True, allow_infinity=True)


@given(temperature=finite, top_k=st.integers(-(2**31), 2**31 - 1),
       top_p=st.none() | finite, min_p=finite, top_logprobs=st.integers(-5, 40))
def test_sampling_ranges(temperature: float, top_k: int, top_p: float | None, min_p: float,
                         top_logprobs: int) -> None:
    msg = pb.SamplingParams(temperature=temperature, top_k=top_k, min_p=min_p,
                            top_logprobs=top_logprobs)
    if top_p is not None:
        msg.top_p = top_p
    expected = set()
    if not (math.isfinite(temperature) and temperature >= 0):
        expected.add("temperature")
    if top_k < 0:
        expected.add("top_k")
    if top_p is not None and not (math.isfinite(top_p) and 0 < top_p <= 1):
        expected.add("top_p")
    if not (math.isfinite(min_p) and 0 <= min_p <= 1):
        expected.add("min_p")
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        expected.add("top_logprobs")
    items = [pb.PrefillItem(seq_id=f"s{i}", token_ids=[1]) for i in range(3)]
    items.append(pb.PrefillItem(seq_id="s3", token_ids=[1], sampling=msg))
    request = prefill(*items)
    if not expected:
        assert convert.prefill_items(request, LIMITS)[3].sampling.top_k == top_k
    else:
        got = violations(convert.prefill_items, request, LIMITS)
        assert set(got) == {f"items[3].sampling.{name}" for name in expected}


def test_limits_are_field_violations() -> None:
    too_many = prefill(*(pb.PrefillItem(seq_id=f"s{i}", token_ids=[1]) for i in range(5)))
    assert "at most 4" in violations(convert.prefill_items, too_many, LIMITS)["items"]
    too_long = prefill(pb.PrefillItem(seq_id="a", token_ids=[1] * 65))
    assert "split" in violations(convert.prefill_items, too_long, LIMITS)["items"]
    got = violations(convert.prefill_items, prefill(
        pb.PrefillItem(seq_id="x" * 257, token_ids=[1]), request_id="r" * 129), LIMITS)
    assert set(got) == {"items[0].seq_id", "request_id"}
    decode = pb.DecodeRequest(items=[pb.DecodeItem(seq_id=f"s{i}") for i in range(5)])
    assert set(violations(convert.decode_items, decode, LIMITS)) == {"items"}
    assert set(violations(convert.release_ids, pb.ReleaseRequest(), LIMITS)) == {"seq_ids"}


def test_capture_phases() -> None:
    assert convert.capture_phases(pb.CaptureRequest()) == ("decode", "prefill")
    assert convert.capture_phases(pb.CaptureRequest(phases=[pb.PHASE_PREFILL])) == ("prefill",)
    bad = pb.CaptureRequest(phases=[pb.PHASE_DECODE, pb.PHASE_UNSPECIFIED, pb.PHASE_DECODE])
    assert set(violations(convert.capture_phases, bad)) == {"phases[1]", "phases[2]"}
    response = convert.capture_response([PhaseCapture("decode", "full")])
    assert response.phases[0].phase == pb.PHASE_DECODE


def test_message_limits_fit_the_largest_valid_request() -> None:
    limits = RequestLimits.from_executor(tiny_config())
    per_item = limits.max_prefill_tokens // limits.max_prefill_items
    biggest = prefill(*(
        pb.PrefillItem(seq_id="x" * limits.max_seq_id_bytes, token_ids=[2**31 - 1] * per_item,
                       sample=True, sampling=pb.SamplingParams(
                           temperature=1, top_k=1, top_p=0.5, min_p=0.5, seed=2**64 - 1,
                           logprobs=True, top_logprobs=MAX_TOP_LOGPROBS))
        for _ in range(limits.max_prefill_items)), request_id="r" * 128)
    assert biggest.ByteSize() <= limits.max_receive_bytes
    output = pb.ItemOutput(seq_id="x" * limits.max_seq_id_bytes, token_id=2**31 - 1,
                           logprob=-1.0, seq_len=2**31 - 1, top_logprobs=[
                               pb.TokenLogprob(token_id=2**31 - 1, logprob=-1.0)] * 20)
    response = pb.PrefillResponse(outputs=[output] * limits.max_decode_items,
                               step=pb.StepInfo(fallback_reason="x" * 64))
    assert response.ByteSize() <= limits.max_send_bytes


@pytest.mark.parametrize(("seq_id", "ok"), [
    ("😀" * 64, True),  # 256 bytes: the most an id may take
    ("😀" * 65, False),  # 260 bytes in 65 characters
    ("é" * 128, True), ("é" * 129, False), ("x" * 256, True), ("x" * 257, False),
])
def test_decode_item_ids_are_checked_in_bytes(seq_id: str, ok: bool) -> None:
    """decode_items skips the byte count for ids too short to exceed it (a character takes
    at most 4 bytes); the limit still holds in bytes at every length."""
    limits = LIMITS
    request = pb.DecodeRequest(items=[pb.DecodeItem(seq_id="ok", token_id=1),
                                      pb.DecodeItem(seq_id=seq_id, token_id=2)])
    if ok:
        items = convert.decode_items(request, limits)
        assert [it.seq_id for it in items] == ["ok", seq_id]
        assert items[1].sampling is GREEDY and items[1].stop_token_ids == ()
    else:
        with pytest.raises(InvalidRequest, match=r"items\[1\]\.seq_id: at most 256 bytes"):
            convert.decode_items(request, limits)


@pytest.mark.parametrize(("token", "logprob", "tops", "stopped"), [
    (None, None, (), False),  # a prefill chunk that samples nothing
    (5, None, (), False),
    (0, 0.0, (), False),  # zeros still present (optional fields)
    (7, -1.5, (), False),
    (7, -1.5, ((7, -1.5), (3, -2.0)), False),  # the general path
    (7, None, (), True),
])
def test_item_output_message_is_what_the_item_says(token: int | None, logprob: float | None,
                                                   tops: tuple[tuple[int, float], ...],
                                                   stopped: bool) -> None:
    """The one-token fast path and the general path give the same message: every field
    the item sets, presence included, and nothing else."""
    from executor.api import ItemOutput

    holder = pb.DecodeResponse()
    convert._add_outputs(holder.outputs, [ItemOutput("s", token, logprob, tops, 9,
                                                     stopped=stopped)])
    (msg,) = holder.outputs
    want = pb.ItemOutput(seq_id="s", seq_len=9, stopped=stopped,
                         top_logprobs=[pb.TokenLogprob(token_id=t, logprob=lp)
                                       for t, lp in tops])
    if token is not None:
        want.token_id = token
    if logprob is not None:
        want.logprob = logprob
    assert msg == want
    assert msg.HasField("token_id") == (token is not None)
    assert msg.HasField("logprob") == (logprob is not None)


def test_health_says_what_the_kernel_switches_resolved_to() -> None:
    """``ModelInfo.kernel_features`` (what ``--fuse-decode-rope`` and ``--pdl`` ``auto``
    chose) reaches Health, as grpcurl users read it."""
    from executor.api import ExecutorStatus, KVStats, ModelInfo

    features = ("fused_decode_rope", "pdl", "tp_projections_send")
    model = ModelInfo("m", "LlamaForCausalLM", "bfloat16", "cuda:0", 1000, 4096, "triton",
                      tensor_parallel_size=2, kernel_features=features,
                      tp_all_reduce="push")
    kv = KVStats(total_tokens=100, free_tokens=100, total_slots=4, free_slots=4,
                 active_sequences=0)
    msg = convert.health_response(pb.SERVER_STATE_READY, ExecutorStatus(model, kv), "v", 1.0, 0)
    assert list(msg.model.kernel_features) == list(features)
    assert msg.model.tp_all_reduce == "push"
    bare = convert.health_response(pb.SERVER_STATE_READY,
                                   ExecutorStatus(ModelInfo("m", "a", "f", "cpu", 1, 1, "t"), kv),
                                   "v", 1.0, 0)
    assert list(bare.model.kernel_features) == [] and bare.model.tp_all_reduce == ""


def test_kernel_features_are_a_metric_per_feature() -> None:
    from prometheus_client import CollectorRegistry

    from executor.api import ModelInfo
    from service.metrics import Metrics
    from service.stats import StatsRecorder

    registry = CollectorRegistry()
    recorder = StatsRecorder(Metrics(registry, ("oom",)))
    recorder.model(ModelInfo("m", "LlamaForCausalLM", "bfloat16", "cuda:0", 1000, 4096,
                             "triton", kernel_features=("fused_decode_rope", "pdl")))
    for feature in ("fused_decode_rope", "pdl"):
        assert registry.get_sample_value("model_executor_kernel_feature",
                                         {"feature": feature}) == 1
    assert registry.get_sample_value("model_executor_kernel_feature",
                                     {"feature": "other"}) is None
    # one process: no all-reduce; a tensor-parallel group: what its all-reduces run as
    assert "model_executor_tp_all_reduce" not in {
        s.name for m in registry.collect() for s in m.samples}
    recorder.model(ModelInfo("m", "LlamaForCausalLM", "bfloat16", "cuda:0", 1000, 4096,
                             "triton", tensor_parallel_size=2, tp_all_reduce="push"))
    assert registry.get_sample_value("model_executor_tp_all_reduce",
                                     {"algorithm": "push"}) == 1


def test_a_steps_rank_timing_lands_in_its_phases_histograms_only_when_known() -> None:
    from prometheus_client import CollectorRegistry

    from service.metrics import Metrics
    from service.stats import StatsRecorder

    registry = CollectorRegistry()
    recorder = StatsRecorder(Metrics(registry, ("oom",)))
    recorder.step(StepInfo("decode", "graph", "", 1, 0, 3.3), 1, 0.004)  # one process
    assert "model_executor_tp_launch_lag_seconds_count" not in {
        s.name for m in registry.collect() for s in m.samples}
    for lag_ms in (0.0, 0.04, 0.2):
        recorder.step(StepInfo("decode", "graph", "", 1, 0, 3.3,
                               ranks=RankTiming(0.01, lag_ms)), 1, 0.004)
    labels = {"phase": "decode"}
    assert registry.get_sample_value("model_executor_tp_launch_lag_seconds_count",
                                     labels) == 3
    assert registry.get_sample_value("model_executor_tp_launch_lag_seconds_sum",
                                     labels) == pytest.approx(0.00024)
    # 0 and 40 us at or under 50 us, 200 us above it
    assert registry.get_sample_value("model_executor_tp_launch_lag_seconds_bucket",
                                     {**labels, "le": "5e-05"}) == 2
    assert registry.get_sample_value("model_executor_tp_launch_lag_seconds_count",
                                     {"phase": "prefill"}) is None
    assert registry.get_sample_value("model_executor_tp_step_delivery_seconds_sum",
                                     labels) == pytest.approx(0.00003)
    # the timing survives the step's completion (``timed``); a multi-step call keeps the
    # worst of its steps
    ranks = RankTiming(0.02, 0.07)
    assert StepInfo("decode", "graph", "", 1, 0, 0.0, 2, ranks).timed(4.0).ranks == ranks
    assert ranks.worst(RankTiming(0.05, 0.01)) == RankTiming(0.05, 0.07)


@pytest.mark.parametrize("long_id", [False, True])
def test_decode_items_column_passes_keep_each_item_and_the_violation_order(
        long_id: bool) -> None:
    """Items are made column by column (from 16 items; item by item when an id may be too
    long, so violations stay in item order): each keeps its token, sampling and stop
    tokens."""
    long = "x" * (257 if long_id else 64)
    limits = RequestLimits.from_executor(tiny_config(max_sequences=32))
    many = [pb.DecodeItem(seq_id=f"m{i}", token_id=i) for i in range(16)]
    request = pb.DecodeRequest(items=[
        pb.DecodeItem(seq_id="a", use_last_sampled=True),
        pb.DecodeItem(seq_id="b", token_id=7, stop_token_ids=[2, 3],
                      sampling=pb.SamplingParams(temperature=0.5, seed=9)),
        pb.DecodeItem(seq_id=long, token_id=0), *many])
    if long_id:
        bad = pb.DecodeRequest(items=[
            pb.DecodeItem(seq_id="a", sampling=pb.SamplingParams(top_k=-1)),
            pb.DecodeItem(seq_id=long), *many])
        with pytest.raises(InvalidRequest) as exc:
            convert.decode_items(bad, limits)
        assert [v.field for v in exc.value.violations] == ["items[0].sampling.top_k",
                                                           "items[1].seq_id"]
        request.items[2].seq_id = "c"
    items = convert.decode_items(request, limits)
    assert [tuple(it) for it in items] == [
        ("a", None, GREEDY, ()),
        ("b", 7, SamplingParams(temperature=0.5, seed=9), (2, 3)),
        ("c" if long_id else long, 0, GREEDY, ()),
        *((f"m{i}", i, GREEDY, ()) for i in range(16))]


@pytest.mark.parametrize("n", [0, 1, 3, 20])
@pytest.mark.parametrize("kind", ["plain", "logprobs", "steps", "none"])
@pytest.mark.parametrize("packed", [False, True])
def test_a_step_response_made_in_place_is_the_same_message(n: int, kind: str,
                                                           packed: bool) -> None:
    """A Session makes its step's answer inside its ``SessionResponse``
    (``fill_step_response``): the same bytes and presence as ``step_response``."""
    from executor.api import ItemOutput, SampledToken, StepInfo, StepResult

    def output(i: int) -> ItemOutput:
        if kind == "none":
            return ItemOutput(f"s{i}", None, None, (), 3 + i)
        if kind == "steps":
            steps = (SampledToken(5, -0.5, ((5, -0.5),)), SampledToken(6, None, ()))
            return ItemOutput(f"s{i}", 6, None, (), 3 + i, steps, i % 2 == 0)
        logprob = -0.25 * i if kind == "logprobs" else None
        return ItemOutput(f"s{i}", 10 + i, logprob, (), 3 + i)

    result = StepResult(tuple(output(i) for i in range(n)),
                        StepInfo("decode", "eager", "no_graph", n, n + 1, 0.5, 2))
    messages: tuple[tuple[str, Any], ...] = (("decode", pb.DecodeResponse),
                                             ("prefill", pb.PrefillResponse))
    for op, message in messages:
        if packed and op == "prefill":
            continue
        # As made before: the message apart, its parts given to its constructor.
        step = result.step
        info = pb.StepInfo(phase=convert.PHASE_TO_PB[step.phase],
                           path=convert.PATH_TO_PB[step.path],
                           fallback_reason=step.fallback_reason, num_tokens=step.num_tokens,
                           padded_tokens=step.padded_tokens, forward_ms=step.forward_ms,
                           num_steps=step.num_steps)
        if packed:
            apart = message(packed=convert._packed(result.outputs), step=info, queue_ms=0.0,
                            execute_ms=1.5)
        else:
            apart = message(step=info, queue_ms=0.0, execute_ms=1.5)
            convert._add_outputs(apart.outputs, result.outputs)
        assert convert.step_response(result, 0.0, 1.5, message, packed) == apart
        expected = pb.SessionResponse(step=7)
        getattr(expected, op).CopyFrom(apart)
        answer = pb.SessionResponse(step=7)
        part = getattr(answer, op)
        convert.fill_step_response(part, result, 0.0, 1.5, packed)
        assert answer == expected
        assert answer.SerializeToString(deterministic=True) == \
            expected.SerializeToString(deterministic=True)
        assert answer.WhichOneof("result") == op
        assert part.HasField("step")
        if op == "decode":
            assert part.HasField("packed") == packed
