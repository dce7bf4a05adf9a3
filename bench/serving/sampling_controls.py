"""What do token masks, logit bias, processed logprobs and grammars cost per decode step?

In one process and one run, on one model shape at one batch (full decode graphs on CUDA):

* ``plain`` / ``masked`` / ``controls``: the synchronous decode call and its graph replay
  span with no controls, with a different token mask on every item, and with mask, an
  8-entry logit bias and PROCESSED logprobs on every item (target: masked <= 1.05x plain);
* ``session`` / ``grammar``: two steps launched ahead (a Session at depth 2, items
  continuing from the device's last samples), ms per token, without and with an EBNF
  grammar (JSON objects, one per line, forever; the stop token banned) on every item,
  compiled against a synthetic vocabulary (``bench/common/grammar_vocab.py``: random
  weights ship no tokenizer) (target: grammar <= 1.15x session).

Every step's path is counted: on CUDA all must be graph replays. Prints a table; ``--out``
adds ``sampling_controls.json``. *CPU* with ``--shape tiny --device cpu`` (a smoke run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import shapes
from bench.common.grammar_vocab import STOP, use_synthetic_tokenizer
from bench.common.meta import device_name, git_commit
from bench.common.server import tokens
from executor.api import DecodeItem, Grammar, PrefillItem, SamplingParams
from executor.config import CacheConfig, ExecutorConfig, GraphConfig, ModelConfig
from executor.executor import Executor
from executor.steps import PendingStep

CTX = 128  # prompt tokens per sequence
GRAMMAR = r'''root ::= line+
line ::= "{\"id\": " [0-9] [0-9]? ", \"name\": \"" [a-z ]* "\", \"ok\": " ("true" | "false") "}\n"
'''


def make_executor(model: str, device: str, batch: int, steps: int) -> Executor:
    cuda = device.startswith("cuda")
    context = CTX + 4 * steps + 64
    cfg = ExecutorConfig(
        model=ModelConfig(source=model), device=device,
        cache=CacheConfig(kv_tokens=batch * context * 2, max_sequences=batch * 2,
                          max_context=context),
        graphs=GraphConfig(decode_mode="full" if cuda else "disabled", prefill_mode="disabled",
                           decode_buckets=(batch,) if cuda else None),
        attention_backend="triton" if cuda else "auto", max_decode_batch=batch,
        max_prefill_tokens=max(batch * CTX, 2048))
    ex = Executor(cfg)
    if cuda:
        ex.capture(["decode"])
    return ex


def random_mask(vocab: int, rng: np.random.Generator) -> bytes:
    """About half of the vocabulary allowed (never none)."""
    bits = rng.random(((vocab + 31) // 32) * 32) < 0.5
    bits[0] = True
    return np.packbits(bits.astype(np.uint8), bitorder="little").tobytes()


def _admit(ex: Executor, ids: list[str], params: list[SamplingParams]) -> list[int]:
    vocab = ex.limits.vocab_size
    out = ex.prefill([PrefillItem(s, tokens(i, CTX, vocab), sampling=p)
                      for i, (s, p) in enumerate(zip(ids, params, strict=True))]).outputs
    return [int(o.token_id) for o in out]  # type: ignore[arg-type]


def synchronous(ex: Executor, tag: str, params: list[SamplingParams], steps: int
                ) -> dict[str, Any]:
    """Median synchronous decode call and replay span (ms), and the steps' paths."""
    ids = [f"{tag}{i}" for i in range(len(params))]
    toks = _admit(ex, ids, params)
    ex.drain_replay_seconds()
    calls, paths = [], Counter[str]()
    for k in range(steps + 5):
        t0 = time.perf_counter()
        res = ex.decode([DecodeItem(s, t, p) for s, t, p in zip(ids, toks, params,
                                                                 strict=True)])
        if k >= 5:
            calls.append(time.perf_counter() - t0)
        paths[res.step.path] += 1
        toks = [int(o.token_id) for o in res.outputs]  # type: ignore[arg-type]
    spans = ex.drain_replay_seconds().get("decode", [])[5:]
    ex.release(ids)
    return {"call_ms": statistics.median(calls) * 1e3,
            "span_ms": statistics.median(spans) * 1e3 if spans else None,
            "paths": dict(paths)}


def launched_ahead(ex: Executor, tag: str, params: list[SamplingParams], steps: int,
                   depth: int = 2) -> dict[str, Any]:
    """ms per token with ``depth`` steps in flight, items continuing on the device."""
    ids = [f"{tag}{i}" for i in range(len(params))]
    _admit(ex, ids, params)
    items = [DecodeItem(s, None, p) for s, p in zip(ids, params, strict=True)]
    inflight: deque[PendingStep] = deque()
    paths = Counter[str]()
    completed = 0
    t0 = time.perf_counter()
    for k in range(steps + 5):
        if k == 5:
            t0, completed = time.perf_counter(), 0
        inflight.append(ex.launch_decode(items))
        paths[inflight[-1].info.path] += 1
        if len(inflight) >= depth:
            ex.complete(inflight.popleft())
            completed += 1
    while inflight:
        ex.complete(inflight.popleft())
        completed += 1
    per_token = (time.perf_counter() - t0) / completed
    ex.release(ids)
    return {"per_token_ms": per_token * 1e3, "paths": dict(paths)}


def run(model: str, device: str, batch: int, steps: int) -> dict[str, Any]:
    ex = make_executor(model, device, batch, steps)
    vocab = ex.limits.vocab_size
    use_synthetic_tokenizer(ex)
    rng = np.random.default_rng(0)
    plain = [SamplingParams()] * batch
    masked = [SamplingParams(allowed_token_bitmask=random_mask(vocab, rng))
              for _ in range(batch)]
    bias = tuple((int(t), 1.0) for t in rng.choice(vocab, 8, replace=False))
    controls = [SamplingParams(temperature=0.8, seed=i, logprobs=True, top_logprobs=2,
                               logprobs_mode="processed", logit_bias=bias,
                               allowed_token_bitmask=p.allowed_token_bitmask)
                for i, p in enumerate(masked)]
    grammar = Grammar("ebnf", GRAMMAR)
    constrained = [SamplingParams(grammar=grammar, logit_bias=((STOP, -100.0),))] * batch
    out: dict[str, Any] = {}
    try:
        import xgrammar  # noqa: F401
    except ImportError:  # a GPU host without the wheel: the mask rows still run
        print("xgrammar is not installed: the grammar rows repeat the unconstrained Session")
        constrained = plain
    # Interleaved twice, each measured after the other once: drift hits both alike.
    for rnd in range(2):
        out[f"plain{rnd}"] = synchronous(ex, f"p{rnd}-", plain, steps)
        out[f"masked{rnd}"] = synchronous(ex, f"m{rnd}-", masked, steps)
        out[f"controls{rnd}"] = synchronous(ex, f"c{rnd}-", controls, steps)
        out[f"session{rnd}"] = launched_ahead(ex, f"s{rnd}-", plain, steps)
        out[f"grammar{rnd}"] = launched_ahead(ex, f"g{rnd}-", constrained, steps)
    return out


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    def best(name: str, key: str) -> float | None:
        vals = [raw[f"{name}{r}"][key] for r in range(2) if raw[f"{name}{r}"][key] is not None]
        return min(vals) if vals else None

    rows = {}
    for name in ("plain", "masked", "controls"):
        rows[name] = {"call_ms": best(name, "call_ms"), "span_ms": best(name, "span_ms")}
    for name in ("session", "grammar"):
        rows[name] = {"per_token_ms": best(name, "per_token_ms")}
    eager = sum(v for r in raw.values() for p, v in r["paths"].items() if p != "graph")
    return {"rows": rows, "eager_steps": eager}


def table(summary: dict[str, Any]) -> str:
    rows = summary["rows"]
    base_call, base_span = rows["plain"]["call_ms"], rows["plain"]["span_ms"]
    lines = ["| run | call ms | x plain | replay span ms | x plain |", "|---|---|---|---|---|"]
    for name in ("plain", "masked", "controls"):
        r = rows[name]
        span = r["span_ms"]
        lines.append(f"| {name} | {r['call_ms']:.3f} | {r['call_ms'] / base_call:.3f} | "
                     + (f"{span:.3f} | {span / base_span:.3f} |" if span and base_span
                        else "- | - |"))
    s, g = rows["session"]["per_token_ms"], rows["grammar"]["per_token_ms"]
    lines += ["", "| Session depth 2 | ms per token | x unconstrained |", "|---|---|---|",
              f"| unconstrained | {s:.3f} | 1.000 |", f"| grammar | {g:.3f} | {g / s:.3f} |",
              "", f"eager steps (must be 0 on CUDA): {summary['eager_steps']}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--models", type=Path, default=Path("/tmp/model-executor-bench"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    path, _ = shapes.model(args.shape, args.models)
    raw = run(str(path), args.device, args.batch, args.steps)
    summary = summarize(raw)
    print(table(summary))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sampling_controls.json").write_text(json.dumps(
            {"commit": git_commit(), "device": device_name(), "shape": args.shape,
             "batch": args.batch, "steps": args.steps, "summary": summary, "raw": raw},
            indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
