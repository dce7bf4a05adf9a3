"""The KV primitives in process: a shared prefix by Fork, speculative decoding by Truncate.
``python -m bench.e2e.kv_primitives --model DIR --device cuda [--out DIR]`` measures:

* **Shared prefix.** ``children`` sequences sharing a ``prefix``-token prompt, each with a
  ``suffix``-token tail: every one prefilled whole, against the prefix prefilled once,
  ``children`` Forks and one call prefilling every suffix. Wall time to the last sampled
  token (medians of rounds) and KV token locations in use afterwards.
* **Speculative decoding.** A greedy continuation by plain Decode calls (the reference),
  then by verify calls (the last accepted token and ``k`` drafts in one ``every_position``
  Prefill, the matching prefix accepted, the rest Truncated), with a perfect drafter (the
  same model's continuation) and a half-right one: accepted drafts per call, time per
  token, tokens matching the reference.

Writes ``kv_primitives.json`` and ``.md`` to ``--out`` (default ``results-local``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.common.meta import git_commit
from executor.api import DecodeItem, PrefillItem
from executor.config import CacheConfig, ExecutorConfig, GraphConfig, ModelConfig
from executor.executor import Executor


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _tokens(seed: int, n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def make_executor(model: str, device: str, children: int, prefix: int, suffix: int,
                  max_prefill: int) -> Executor:
    cuda = device.startswith("cuda")
    context = prefix + suffix + 256
    return Executor(ExecutorConfig(
        model=ModelConfig(source=model), device=device,
        cache=CacheConfig(kv_tokens=2 * children * context, max_sequences=2 * children + 4,
                          max_context=context),
        graphs=GraphConfig(decode_mode="full" if cuda else "disabled",
                           prefill_mode="breakable" if cuda else "disabled"),
        attention_backend="triton" if cuda else "auto", max_prefill_tokens=max_prefill,
        max_decode_batch=max(children, 1)))


def shared_prefix(ex: Executor, device: str, children: int, prefix: int, suffix: int,
                  rounds: int) -> dict[str, Any]:
    vocab = ex.model_info.vocab_size
    common = _tokens(1, prefix, vocab)
    tails = [_tokens(100 + i, suffix, vocab) for i in range(children)]
    per_call = max(1, ex.config.max_prefill_tokens // (prefix + suffix))
    full_ms, fork_ms, agree = [], [], 0
    used: dict[str, int] = {}
    for r in range(rounds):
        base = ex.kv_stats().free_tokens
        _sync(device)
        t0 = time.perf_counter()
        full_tokens: list[int | None] = []
        for start in range(0, children, per_call):
            items = [PrefillItem(f"full{r}-{i}", common + tails[i])
                     for i in range(start, min(children, start + per_call))]
            full_tokens += [o.token_id for o in ex.prefill(items).outputs]
        full_ms.append((time.perf_counter() - t0) * 1e3)
        used["full"] = base - ex.kv_stats().free_tokens
        ex.release([f"full{r}-{i}" for i in range(children)])

        _sync(device)
        t0 = time.perf_counter()
        ex.prefill([PrefillItem(f"root{r}", common, sample=False)])
        for i in range(children):
            ex.fork(f"root{r}", f"kid{r}-{i}")
        res = ex.prefill([PrefillItem(f"kid{r}-{i}", tails[i]) for i in range(children)])
        fork_ms.append((time.perf_counter() - t0) * 1e3)
        used["fork"] = base - ex.kv_stats().free_tokens
        agree = sum(o.token_id == t for o, t in zip(res.outputs, full_tokens, strict=True))
        ex.release([f"root{r}", *(f"kid{r}-{i}" for i in range(children))])
    return {"children": children, "prefix": prefix, "suffix": suffix, "rounds": rounds,
            "full_ms_median": statistics.median(full_ms[1:] or full_ms),
            "fork_ms_median": statistics.median(fork_ms[1:] or fork_ms),
            "full_kv_tokens": used["full"], "fork_kv_tokens": used["fork"],
            "first_tokens_agreeing": agree,
            "full_calls": -(-children // per_call)}


def _verify_loop(ex: Executor, device: str, sid: str, prompt: list[int], ref: list[int],
                 k: int, drafter: str) -> dict[str, Any]:
    """Greedy continuation of ``len(ref) - 1`` tokens by verify calls of ``k`` drafts."""
    n, vocab = len(ref) - 1, ex.model_info.vocab_size
    out = [ref[0]]
    ex.prefill([PrefillItem(sid, prompt)])
    calls = accepted_total = 0
    _sync(device)
    t0 = time.perf_counter()
    while len(out) < n + 1:
        guess = ref[len(out): len(out) + k]
        if drafter == "half":
            guess = guess[: k // 2] + [(t + 1) % vocab for t in guess[k // 2:]]
        res = ex.prefill([PrefillItem(sid, [out[-1], *guess], every_position=True)]
                         ).outputs[0]
        calls += 1
        model = [int(p.token_id) for p in res.positions]
        accepted = 0
        while accepted < len(guess) and guess[accepted] == model[accepted]:
            accepted += 1
        accepted_total += accepted
        out += model[: accepted + 1]
        keep = len(prompt) + len(out) - 1  # the newest token is not in the cache yet
        if res.seq_len > keep:
            ex.truncate(sid, keep)
    _sync(device)
    made = len(out) - 1  # the last call may overshoot n
    ms = (time.perf_counter() - t0) * 1e3 / made
    ex.release([sid])
    out = out[: n + 1]
    match = next((i for i, (x, y) in enumerate(zip(out, ref, strict=True)) if x != y), n + 1)
    return {"k": k, "drafter": drafter, "verify_calls": calls, "tokens": made,
            "accepted_drafts_per_call": accepted_total / calls,
            "tokens_per_call": n / calls, "ms_per_token": ms,
            "tokens_matching_reference": match}


def speculative(ex: Executor, device: str, prompt_len: int, n: int, ks: list[int]
                ) -> dict[str, Any]:
    prompt = _tokens(7, prompt_len, ex.model_info.vocab_size)
    first = ex.prefill([PrefillItem("ref", prompt)]).outputs[0].token_id
    assert first is not None
    ref: list[int] = [first]
    times = []
    while len(ref) < n + 1 + 8:  # the first 8 steps warm up, the rest are timed
        _sync(device)
        t0 = time.perf_counter()
        tok = ex.decode([DecodeItem("ref", ref[-1])]).outputs[0].token_id
        times.append(time.perf_counter() - t0)
        assert tok is not None
        ref.append(tok)
    plain_ms = statistics.median(times[8:]) * 1e3
    ex.release(["ref"])
    ref = ref[: n + 1]
    _verify_loop(ex, device, "warm-up", prompt, ref, ks[0], "perfect")  # first uses
    runs = [_verify_loop(ex, device, f"spec{k}{d}", prompt, ref, k, d)
            for k in ks for d in ("perfect", "half")]
    for r in runs:
        r["speedup_vs_decode"] = plain_ms / r["ms_per_token"]
    return {"prompt": prompt_len, "tokens": n, "decode_ms_per_token": plain_ms, "runs": runs}


def markdown(result: dict[str, Any]) -> str:
    s, p = result["shared_prefix"], result["speculative"]
    lines = [f"# KV primitives ({result['device']}, {result['model']}, commit "
             f"{result['commit']})", "",
             f"## {s['children']} sequences sharing a {s['prefix']}-token prefix "
             f"(+{s['suffix']} own tokens each)", "",
             "| | wall ms (median) | KV tokens in use |", "|---|---:|---:|",
             f"| {s['children']} full prefills ({s['full_calls']} calls) | "
             f"{s['full_ms_median']:.1f} | {s['full_kv_tokens']} |",
             f"| prefix once + {s['children']} Forks + 1 suffix call | "
             f"{s['fork_ms_median']:.1f} | {s['fork_kv_tokens']} |", "",
             f"First sampled tokens equal in both: {s['first_tokens_agreeing']} of "
             f"{s['children']} (in bf16 another chunking rounds differently).", "",
             f"## Speculative decoding through the API ({p['tokens']} tokens after a "
             f"{p['prompt']}-token prompt)", "",
             f"Plain greedy Decode: {p['decode_ms_per_token']:.3f} ms per token (median of "
             "synchronous calls).", "",
             "| k | drafter | verify calls | accepted drafts / call | tokens / call | "
             "ms / token | vs Decode | leading tokens equal to Decode's |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in p["runs"]:
        lines.append(f"| {r['k']} | {r['drafter']} | {r['verify_calls']} | "
                     f"{r['accepted_drafts_per_call']:.2f} | {r['tokens_per_call']:.2f} | "
                     f"{r['ms_per_token']:.3f} | {r['speedup_vs_decode']:.2f}x | "
                     f"{r['tokens_matching_reference']} / {p['tokens'] + 1} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=Path("results-local"))
    ap.add_argument("--children", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--suffix", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-prefill-tokens", type=int, default=8192)
    ap.add_argument("--spec-tokens", type=int, default=64)
    ap.add_argument("--spec-k", default="4,8")
    a = ap.parse_args(argv)
    ex = make_executor(a.model, a.device, a.children, a.prefix, a.suffix,
                       a.max_prefill_tokens)
    if a.device.startswith("cuda"):
        ex.capture()
    result = {
        "model": a.model, "device": torch.cuda.get_device_name() if a.device.startswith("cuda")
        else "CPU", "commit": git_commit(),
        "shared_prefix": shared_prefix(ex, a.device, a.children, a.prefix, a.suffix, a.rounds),
        "speculative": speculative(ex, a.device, 128, a.spec_tokens,
                                   [int(k) for k in a.spec_k.split(",")]),
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "kv_primitives.json").write_text(json.dumps(result, indent=2))
    md = markdown(result)
    (a.out / "kv_primitives.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
