"""``bench.serving.stand_in``: the simulated device is one in-order queue under the real
executor."""

from __future__ import annotations

import pytest

from bench.serving.stand_in import StandInExecutor, VirtualEvent, parse_spans
from executor.api import DecodeItem, PrefillItem
from executor.config import CacheConfig, ExecutorConfig

SPAN = 0.4  # long against a launch's host time, so back-to-back launches queue


def _executor() -> StandInExecutor:
    return StandInExecutor(ExecutorConfig(cache=CacheConfig(kv_tokens=512, max_sequences=4,
                                                            max_context=128),
                                          max_decode_batch=4),
                           parse_spans(f"1:{SPAN / 2 * 1e3},4:{SPAN * 1e3}"))


def test_spans_by_batch() -> None:
    ex = _executor()
    assert ex.spans == {1: SPAN / 2, 4: SPAN}
    assert ex.span_s(1) == SPAN / 2 and ex.span_s(2) == SPAN and ex.span_s(9) == SPAN


def test_steps_queue_in_launch_order_and_complete_with_the_real_host_path() -> None:
    ex = _executor()
    ids = ["a", "b"]
    first = ex.prefill([PrefillItem(s, [3, 4, 5]) for s in ids])  # waits for its span
    assert [o.seq_len for o in first.outputs] == [3, 3]
    launched = [ex.launch_decode([DecodeItem(s, None) for s in ids]) for _ in range(3)]
    events = [step.done for step in launched]
    assert all(isinstance(e, VirtualEvent) for e in events)
    ready = [e.ready_at for e in events]  # type: ignore[union-attr]
    # one queue: each step starts when the one before it ends, with the span of its batch
    assert ready[1] - ready[0] == pytest.approx(SPAN) and ready[2] - ready[1] == pytest.approx(SPAN)
    assert not events[2].query()  # type: ignore[union-attr]
    ex.abort(launched[2])  # waits for its end, then rolls it back
    assert events[2].query()  # type: ignore[union-attr]
    results = [ex.complete(step) for step in launched[:2]]
    assert [[o.seq_len for o in r.outputs] for r in results] == [[4, 4], [5, 5]]
    assert ex.kv.get("a").length == 5  # type: ignore[union-attr]
    # after the roll-back the last sampled token is gone: the next decode gives its token
    out = ex.decode([DecodeItem("a", 7)])
    assert out.outputs[0].seq_len == 6
    ex.kv.check_invariants()


def test_a_launch_takes_the_extra_host_time_holding_the_gil() -> None:
    """``launch_host_s``: each launch busy-waits (as CUDA calls hold the GIL), so a thread
    that wants the GIL meanwhile waits for the launch (below Python's 5 ms switch interval,
    which would take the GIL away from a longer one)."""
    import itertools
    import sys
    import threading
    import time

    hold = 0.003
    assert sys.getswitchinterval() > hold
    ex = StandInExecutor(ExecutorConfig(cache=CacheConfig(kv_tokens=512, max_sequences=4,
                                                          max_context=128)),
                         parse_spans("1:0.1"), launch_host_s=hold)
    ex.prefill([PrefillItem("a", [3, 4, 5])])
    ticks: list[float] = []
    stop = threading.Event()

    def tick() -> None:  # wants the GIL every 0.2 ms
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.0002)

    thread = threading.Thread(target=tick)
    thread.start()
    time.sleep(0.01)
    start = time.perf_counter()
    ex.launch_decode([DecodeItem("a", 6)])
    took = time.perf_counter() - start
    time.sleep(0.005)
    stop.set()
    thread.join()
    assert took >= hold
    during = [b - a for a, b in itertools.pairwise(ticks) if a <= start + took and b >= start]
    assert max(during) >= 0.9 * hold, "the ticker ran during the launch: the GIL was free"


def test_the_session_bench_in_process_is_bound_by_the_simulated_device() -> None:
    """``bench.serving.session_latency``'s in-process part on the stand-in: launching two
    ahead takes the simulated span per step (not less: the device is one queue), and every
    figure is there for each batch."""
    from bench.serving.session_latency import executor_config, in_process

    spans = "1:20,4:30"  # ms: long against the tiny model's host path
    out = in_process(executor_config("tiny", "cpu", [1, 4], 12), [1, 4], 12, stand_in=spans)
    for bs, span in (("1", 20.0), ("4", 30.0)):
        row = out[bs]
        assert row["span_ms"] == pytest.approx(span)
        assert span * 0.99 <= row["launched_ahead_ms"] <= span * 1.5
        assert row["call_ms"] >= span * 0.99  # a synchronous call waits for its step
        assert row["launch_host_us"] > 0 and row["complete_host_us"] > 0


def test_graphs_take_a_graph_replays_host_path() -> None:
    """``graphs``: decode steps are packed for a bucket and "replayed" (path graph, padded
    to the bucket, the rows' argmax from the replay), with the eager stand-in's outputs
    and KV."""
    outs, infos = [], []
    for graphs in (False, True):
        ex = StandInExecutor(ExecutorConfig(cache=CacheConfig(kv_tokens=512, max_sequences=4,
                                                              max_context=128),
                                            max_decode_batch=4),
                             parse_spans("1:0.01"), graphs=graphs)
        ids = ["a", "b", "c"]
        ex.prefill([PrefillItem(s, [3, 4, 5 + i]) for i, s in enumerate(ids)])
        steps = [ex.decode([DecodeItem(s, None) for s in ids]) for _ in range(3)]
        outs.append([[(o.seq_id, o.token_id, o.seq_len) for o in r.outputs] for r in steps])
        infos.append([(r.step.path, r.step.padded_tokens) for r in steps])
        ex.kv.check_invariants()
    assert outs[0] == outs[1]
    assert infos == [[("eager", 0)] * 3, [("graph", 1)] * 3]
