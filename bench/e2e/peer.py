"""The peer on the same weights: HF transformers eager and static-cache + torch.compile.

Decode ms/token comes from the difference of two generation lengths from the same prompt,
so prefill and fixed costs cancel: ``(t(n2) - t(n1)) / (n2 - n1)``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch


def _load(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    load: Any = AutoModelForCausalLM.from_pretrained
    # bf16 on the GPU, as ours; float32 on a CPU-only machine (the smoke profile).
    cuda = torch.cuda.is_available()
    model = load(str(model_dir), dtype=torch.bfloat16 if cuda else torch.float32,
                 attn_implementation="sdpa")
    return model.to(_device()).eval()


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _generate_s(model: Any, ids: torch.Tensor, n: int, repeats: int, **kw: Any) -> float:
    """Seconds of one ``generate`` of ``n`` tokens: the fastest of ``repeats`` (the run
    least disturbed by other work; ``hf_decode_ms`` subtracts two of them, and medians
    under load could make that difference negative)."""
    times = []
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                       min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
                       **kw)
        _sync()
        times.append(time.perf_counter() - t0)
    return min(times)


@torch.inference_mode()
def hf_decode_ms(model: Any, ctx: int, static_compile: bool, n1: int = 16, n2: int = 80,
                 repeats: int = 3) -> float:
    ids = torch.randint(0, model.config.vocab_size, (1, ctx), device=_device())
    kw: dict[str, Any] = {}
    if static_compile:
        # With a static cache, generate compiles the forward itself (its CompileConfig:
        # CUDA graphs through "reduce-overhead"); compiling model.forward by hand on top of
        # that fails (CUDA-graph outputs overwritten between the two compiled layers).
        kw["cache_implementation"] = "static"
        _generate_s(model, ids, n2, 2, **kw)  # compile + warm-up outside the timing
    else:
        _generate_s(model, ids, n1, 1)
    t1 = _generate_s(model, ids, n1, repeats, **kw)
    t2 = _generate_s(model, ids, n2, repeats, **kw)
    return (t2 - t1) / (n2 - n1) * 1e3


@torch.inference_mode()
def hf_prefill_ms(model: Any, tokens: int, repeats: int = 10) -> float:
    from bench.common.hardware import time_ms

    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=_device())
    return time_ms(lambda: model(ids, use_cache=False, logits_to_keep=1), repeats=repeats)


def measure(model_dir: Path, ctx: int, prefill_tokens: list[int], with_compile: bool
            ) -> dict[str, Any]:
    model = _load(model_dir)
    out: dict[str, Any] = {"decode_bs1_eager_ms": hf_decode_ms(model, ctx, False)}
    out["prefill_eager_ms"] = {str(n): hf_prefill_ms(model, n) for n in prefill_tokens}
    if with_compile:
        try:
            out["decode_bs1_static_compile_ms"] = hf_decode_ms(model, ctx, True)
        except Exception as exc:  # report, do not lose the rest of the run
            out["decode_bs1_static_compile_error"] = f"{type(exc).__name__}: {exc}"[:300]
    del model
    torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.e2e.peer --shape NAME --out FILE``: the peer alone on one shape."""
    import argparse
    import json

    from bench.common import shapes

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--shape", default="llama-3.2-1b", choices=sorted(shapes.SHAPES))
    ap.add_argument("--models", type=Path, default=Path("/tmp/model-executor-bench"))
    ap.add_argument("--prefill", default="128,2048", help="prefill token counts ('' for none)")
    ap.add_argument("--static-only", action="store_true",
                    help="only static-cache + torch.compile decode (a follow-up run)")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON file (default: results-local/peer-SHAPE.json)")
    args = ap.parse_args(argv)
    model_dir = shapes.write_shape(args.shape, args.models)
    tokens = [int(t) for t in args.prefill.split(",") if t]
    result: dict[str, Any] = {"shape": args.shape}
    if args.static_only:
        try:
            result["decode_bs1_static_compile_ms"] = hf_decode_ms(_load(model_dir), 512, True)
        except Exception as exc:  # report it like measure() does
            result["decode_bs1_static_compile_error"] = f"{type(exc).__name__}: {exc}"[:300]
    else:
        result.update(measure(model_dir, 512, tokens, True))
    out = args.out or Path("results-local", f"peer-{args.shape}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
