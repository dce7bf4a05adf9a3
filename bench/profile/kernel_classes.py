"""Which part of a decoder step each GPU kernel is, and how many bytes that part must move.

Pure functions over a step's kernel list (names and device times, as the torch profiler
records them), so the grouping is tested on CPU; ``bench.profile.kernel_table`` and
``bench.profile.tp_profile`` feed them profiles of real graph steps. A library, not an
entry point.

GEMM kernels carry no hint of which projection they compute (qkv and o often run the same
cuBLAS kernel), so their role comes from their position: a step's GEMMs form
``4 * layers + 1`` groups (a GEMM kernel and the split-K reduce kernels after it are one
group) in the order qkv, o, gate_up, down per layer, then the LM head. Every other kernel
is classed by its name. A GEMM with a fused prologue (``skinny_gemm``'s norm or
SiLU-and-mul) counts under its projection.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

GEMM_ROLES = ("qkv", "o", "gate_up", "down")
#: Table order of the classes (rows absent from a step are left out).
CLASSES = ("gate_up", "down", "qkv", "o", "lm_head", "gemm", "moe", "attention", "norm", "rope",
           "silu", "other", "collective", "copy", "idle", "wait")
#: A gap between two kernels of a step at least this long is the GPU waiting on the host
#: (``wait``: the host preparing the replay, launching eager kernels, sampling); shorter
#: gaps are ``idle``, the launch latency between kernels the host had queued in time.
WAIT_US = 20.0

# Name fragments, checked in this order; lower case. Our Triton kernels are named in
# executor/kernels and executor/attention/triton_kernels.
# Collectives first: NCCL's kernels and torch's symmetric-memory all-reduce (tensor
# parallelism); their time includes waiting inside the kernel for the other ranks.
_BY_NAME: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("collective", ("nccl", "all_reduce", "allreduce", "all_gather", "allgather")),
    # the fused mixture-of-experts kernels (executor/kernels/moe): align, the two GEMMs,
    # one token's experts in one launch
    ("moe", ("_align_kernel", "_gate_up_kernel", "_down_kernel", "_moe_decode_one_token")),
    ("gemm", ("nvjet", "gemm", "gemv", "splitkreduce", "xmma", "cutlass", "_skinny_",
              "_fp8_dot_", "_w8a16_")),
    ("attention", ("_decode_split", "_decode_reduce", "_extend_kernel", "_extend_fixed_grid",
                   "_store_kv", "batchdecode", "batchprefill", "flashinfer")),
    ("norm", ("rms_norm",)),  # Gemma's too (_offset_rms_norm)
    ("rope", ("_rope",)),
    ("silu", ("silu", "gelu_tanh")),  # the gated MLP's activation, SiLU or GELU
    ("copy", ("memcpy", "memset")),
)


@dataclass(frozen=True)
class Kernel:
    """One kernel launch of a step: name, start and end in microseconds (device clock)."""

    name: str
    start_us: float
    end_us: float

    @property
    def us(self) -> float:
        return self.end_us - self.start_us


def name_class(name: str) -> str:
    """``gemm`` (role decided by position), a class of ``CLASSES``, or ``other``."""
    low = name.lower()
    for cls, fragments in _BY_NAME:
        if any(f in low for f in fragments):
            return cls
    return "other"


def classify(kernels: Sequence[Kernel], num_layers: int) -> list[str]:
    """The class of each kernel of ONE step, in launch order. When the GEMM groups do not
    number ``4 * num_layers + 1``, positions say nothing: every GEMM is then ``gemm``."""
    by_name = [name_class(k.name) for k in kernels]
    classes = list(by_name)
    groups = -1
    for i, (cls, k) in enumerate(zip(by_name, kernels, strict=True)):
        if cls != "gemm":
            continue
        if "reduce" not in k.name.lower() or groups < 0:  # a reduce joins its GEMM's group
            groups += 1
        classes[i] = "lm_head" if groups == 4 * num_layers else GEMM_ROLES[groups % 4]
    if groups + 1 != 4 * num_layers + 1:
        return by_name
    return classes


def step_table(kernels: Sequence[Kernel], num_layers: int) -> dict[str, dict[str, float]]:
    """``class -> {"us", "n"}`` for one step (kernels in any order), with ``idle`` and
    ``wait``: the gaps with no kernel running, shorter and longer than ``WAIT_US``.
    Busy time plus both is the step's span.

    Kernels may overlap: under programmatic dependent launch a kernel starts while its
    predecessor finishes and waits inside for it. Each kernel counts only from where every
    earlier-started kernel had ended (its exclusive time on the step's critical path); the
    overlap counts for the kernel that was running first."""
    ordered = sorted(kernels, key=lambda k: k.start_us)
    table: dict[str, dict[str, float]] = {}
    gaps: list[float] = []
    frontier = ordered[0].start_us if ordered else 0.0  # where every earlier kernel ended
    for k, cls in zip(ordered, classify(ordered, num_layers), strict=True):
        if k is not ordered[0]:
            gaps.append(max(0.0, k.start_us - frontier))
        row = table.setdefault(cls, {"us": 0.0, "n": 0.0})
        row["us"] += max(0.0, k.end_us - max(k.start_us, frontier))
        row["n"] += 1
        frontier = max(frontier, k.end_us)
    short = [g for g in gaps if g < WAIT_US]
    table["idle"] = {"us": sum(short), "n": float(len(short))}
    table["wait"] = {"us": sum(gaps) - sum(short), "n": float(len(gaps) - len(short))}
    return table


def median_classes(tables: Sequence[dict[str, dict[str, float]]]) -> dict[str, float]:
    """µs per class, the median over steps (a class a step lacks counts 0 there)."""
    import statistics

    names = sorted({c for t in tables for c in t})
    return {c: statistics.median(t.get(c, {"us": 0.0})["us"] for t in tables) for c in names}


def class_bytes(spec: Any, phase: str, tokens: int, context: int, sampled: int,
                act_bytes: int = 2) -> dict[str, int]:
    """The fewest bytes each class must move in one step (weights, KV, activations read
    and written once), for ``tokens`` new tokens; decode reads ``context`` cached tokens
    per sequence (``tokens`` sequences); prefill is one sequence with no cached prefix.
    ``sampled`` rows go through the LM head. The unfused ops' bytes are counted even when
    a kernel fuses them (the table then shows the fused kernel under one class)."""
    h, i, v = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    q, kv, layers, m = spec.q_size, spec.kv_size, spec.num_layers, tokens
    read = kv_read_tokens(spec, context)  # cached tokens read per sequence, all layers

    def gemm(k: int, n: int, rows: int = m) -> int:
        return (k * n + rows * k + rows * n) * act_bytes

    if phase == "decode":  # each sequence reads its context's K and V (a sliding layer
        # only its window's), writes one token's
        attn = m * (2 * read * kv + layers * (q + 2 * kv + q)) * act_bytes
    else:  # K/V of the new tokens written once and read once, q read, out written
        attn = layers * m * (4 * kv + 2 * q) * act_bytes
    return {
        "qkv": layers * gemm(h, q + 2 * kv),
        "o": layers * gemm(q, h),
        "gate_up": layers * gemm(h, 2 * i),
        "down": layers * gemm(i, h),
        "lm_head": gemm(h, v, sampled),
        "attention": attn,
        "norm": (2 * layers + 1) * 4 * m * h * act_bytes,  # x, residual in; out, residual out
        "rope": layers * 2 * m * (q + kv) * act_bytes,
        "silu": layers * 3 * m * i * act_bytes,
    }


def kv_read_tokens(spec: Any, context: int) -> int:
    """Cached tokens one decoding sequence of ``context`` tokens reads, summed over the
    layers: a sliding layer (``ModelSpec.layer_windows``) reads only its window."""
    windows = getattr(spec, "layer_windows", ()) or (0,) * spec.num_layers
    return sum(min(context, w) if w else context for w in windows)


def floor_ms(spec: Any, phase: str, tokens: int, context: int, bandwidth_gbs: float,
             tflops: float, weight_bytes: int) -> tuple[float, str]:
    """The step's floor and what bounds it: decode reads the weights and every sequence's
    KV once (a sliding layer's window of it; ``bandwidth``); prefill is the larger of
    reading the weights once and its FLOPs (2 * params * tokens, as ``bench.e2e.run``) at
    the measured matmul rate."""
    kv_bytes = 2 * spec.kv_size * 2  # K and V, bf16, per token and layer
    if phase == "decode":
        read = tokens * kv_read_tokens(spec, context) * kv_bytes
        return (weight_bytes + read) / (bandwidth_gbs * 1e9) * 1e3, "bytes"
    read_ms = weight_bytes / (bandwidth_gbs * 1e9) * 1e3
    # (a mixture of experts: the parameters one token uses, its top-k experts)
    params = spec.num_params(active=True) if getattr(spec, "moe", None) else spec.num_params()
    flops_ms = 2 * params * tokens / (tflops * 1e12) * 1e3
    return (flops_ms, "flops") if flops_ms > read_ms else (read_ms, "bytes")


def markdown_case(name: str, case: dict[str, Any], before: dict[str, Any] | None = None) -> str:
    """One case's table: µs per step, launches, bytes, achieved TB/s per class; with
    ``before``, its µs beside."""
    def gpu(c: dict[str, Any]) -> float:  # kernels and the short gaps between them
        return float(c["busy_ms"] + c["classes"].get("idle", {"us": 0.0})["us"] / 1e3)

    head = (f"**{name}**: kernels + idle {gpu(case):.3f} ms "
            f"(kernels {case['busy_ms']:.3f}), floor {case['floor_ms']:.3f} ms "
            f"({case['floor_by']}), {gpu(case) / case['floor_ms']:.2f}x the floor; "
            f"{case['kernels_per_step']:.0f} kernels per step; whole call on the GPU "
            f"{case['span_ms']:.3f} ms with host waits")
    if before is not None:
        head += (f". Before: kernels + idle {gpu(before):.3f} ms "
                 f"({gpu(before) / before['floor_ms']:.2f}x), "
                 f"{before['kernels_per_step']:.0f} kernels, call {before['span_ms']:.3f} ms")
    cols = "| class | n/step | µs/step | " + ("before µs | " if before else "") + \
        "MB moved | TB/s |"
    lines = [head, "", cols, "|---|---:|---:|" + ("---:|" if before else "") + "---:|---:|"]
    rows = case["classes"]
    old = before["classes"] if before else {}
    for cls in CLASSES:
        if cls not in rows and cls not in old:
            continue
        r = rows.get(cls, {"us": 0.0, "n": 0.0})
        nbytes = r.get("bytes")
        tbs = f"{nbytes / (r['us'] * 1e-6) / 1e12:.2f}" if nbytes and r["us"] > 0 else ""
        mb = f"{nbytes / 1e6:.1f}" if nbytes else ""
        prev = (f"{old[cls]['us']:.1f} | " if cls in old else "— | ") if before else ""
        lines.append(f"| {cls} | {r['n']:.0f} | {r['us']:.1f} | {prev}{mb} | {tbs} |")
    return "\n".join(lines) + "\n"
