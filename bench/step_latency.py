"""Call medians of a 128-token breakable prefill and a batch-1 full-graph decode, for
A/B runs of two code trees on one machine.

``python -m bench.step_latency /tmp/model-executor-bench/llama-3.2-1b`` from each tree's
root, alternating the trees several times (host speed drifts within minutes on the lent
machines, so only interleaved rounds compare). Prints one line: both call medians (host
work included, as ``Executor.prefill``/``decode`` return) and the median replay spans
(CUDA events around the graph replays, no host sync added). Only the two buckets used
are captured, so a run takes seconds after the model has loaded.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from bench import switches as bench_switches
from executor.api import DecodeItem, PrefillItem
from executor.config import CacheConfig, ExecutorConfig, GraphConfig, ModelConfig
from executor.executor import Executor


def measure(source: str, rounds: int, calls: int, tokens: int = 128,
            switches: dict[str, str] | None = None) -> str:
    ex = Executor(ExecutorConfig(
        model=ModelConfig(source=source, dtype="bfloat16"), device="cuda",
        cache=CacheConfig(kv_tokens=64 * 1024, max_sequences=64, max_context=4096),
        graphs=GraphConfig(decode_mode="full", prefill_mode="breakable", decode_buckets=(1, 2),
                           prefill_buckets=(tokens // 2, tokens)),
        attention_backend="triton", max_decode_batch=64, max_prefill_tokens=4096,
        **(switches or {})))
    ex.capture(["decode", "prefill"])
    ids = torch.randint(0, ex.model_info.vocab_size, (tokens,),
                        generator=torch.Generator().manual_seed(0)).tolist()
    first = ex.prefill([PrefillItem("d", list(range(1, 200)))]).outputs[0].token_id
    assert first is not None
    tok, n = first, 0
    prefill_s: list[float] = []
    decode_s: list[float] = []
    for _ in range(rounds):  # the two kinds of call alternate in blocks
        for _ in range(calls):
            n += 1
            t0 = time.perf_counter()
            ex.prefill([PrefillItem(f"p{n}", ids)])
            prefill_s.append(time.perf_counter() - t0)
            ex.release([f"p{n}"])
        for _ in range(calls):
            t0 = time.perf_counter()
            out = ex.decode([DecodeItem("d", tok)]).outputs[0]
            decode_s.append(time.perf_counter() - t0)
            assert out.token_id is not None
            tok = out.token_id
    spans = ex.drain_replay_seconds()
    warm = calls // 3  # the first calls of a process are slower
    return (f"prefill{tokens} {statistics.median(prefill_s[warm:]) * 1e3:.3f} ms  "
            f"decode1 {statistics.median(decode_s[warm:]) * 1e3:.3f} ms  "
            f"spans prefill {statistics.median(spans['prefill']) * 1e3:.3f} "
            f"decode {statistics.median(spans['decode']) * 1e3:.3f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("model", help="HF model directory (e.g. a bench shape)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--calls", type=int, default=60, help="calls per kind per round")
    bench_switches.add_arguments(ap)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.step_latency needs a CUDA device", file=sys.stderr)
        return 2
    print(measure(args.model, args.rounds, args.calls, switches=bench_switches.overrides(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
