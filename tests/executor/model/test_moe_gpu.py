"""Mixture of experts on the GPU (marker ``gpu``): the fused kernels at realistic shapes,
without a host sync and inside a CUDA graph, and whole MoE models under decode full graphs
and breakable prefill capture.

Kernel outputs (bf16) against the eager reference: the Qwen3-30B-A3B expert shape (128
experts, top 8, hidden 2048, width 768) from decode batch 1 to a 2048-token prefill, and
Mixtral-8x7B's at TP = 2 (8 experts, top 2, hidden 4096, width 7168); the decode path at
1, 2 and 4 tokens at those shapes and Mixtral's full one, in and out of a graph. Models
(bf16, an FP8 block-wise checkpoint, FP8 at load): every step of a chunked prefill and
ten decode steps replays a graph (no eager fallback) and agrees with an eager executor on
every clear greedy choice; graph logits equal eager ones; FP8 experts agree with their
dequantized model.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from executor.api import PrefillItem
from executor.config import CacheConfig, ExecutorConfig, GraphConfig, ModelConfig
from executor.executor import Executor
from tests.helpers.fp8_models import write_fp8_copy
from tests.helpers.gpu import (
    LOGIT_ATOL,
    LOGIT_RTOL,
    PREFILL_BUCKETS,
    assert_same_greedy,
    compare,
    graph_and_eager,
    greedy_agrees,
    rand_tokens,
)
from tests.helpers.moe_models import gpu_moe_model
from tests.helpers.one_launch import count_one_launches

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

# (experts, top_k, hidden, expert width)
QWEN3_30B = (128, 8, 2048, 768)
MIXTRAL_TP2 = (8, 2, 4096, 7168)


def _experts(shape: tuple[int, int, int, int], seed: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    e, _, h, i = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, device="cuda", generator=g).div_(h**0.5).bfloat16()
    w2 = torch.randn(e, h, i, device="cuda", generator=g).div_(i**0.5).bfloat16()
    router = torch.randn(e, h, device="cuda", generator=g).div_(h**0.5).bfloat16()
    return w13, w2, router


@pytest.mark.parametrize(("shape", "tokens"), [
    (QWEN3_30B, 1), (QWEN3_30B, 3), (QWEN3_30B, 64), (QWEN3_30B, 512), (QWEN3_30B, 2048),
    (MIXTRAL_TP2, 1), (MIXTRAL_TP2, 64), (MIXTRAL_TP2, 1024)])
def test_fused_matches_eager_at_real_shapes(shape: tuple[int, int, int, int],
                                            tokens: int) -> None:
    from executor.kernels.moe.fused import fused_experts
    from executor.kernels.moe.reference import experts_reference, route

    w13, w2, router = _experts(shape, tokens)
    x = torch.randn(tokens, shape[2], device="cuda").bfloat16()
    weights, ids = route(x @ router.t(), shape[1], True, True)
    got = fused_experts(x, w13, w2, weights, ids)
    want = experts_reference(x, w13, w2, weights, ids)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("tokens", [1, 64, 2048])
def test_route_kernel_matches_torch_route(tokens: int) -> None:
    from executor.kernels.moe.reference import route
    from executor.kernels.moe.route import route_topk

    logits = torch.randn(tokens, 128, device="cuda").bfloat16()
    for renormalize in (True, False):
        w, ids = route_topk(logits, 8, renormalize, renormalize)
        want_w, want_ids = route(logits, 8, renormalize, renormalize)
        # bf16 logits tie often: slot by slot the same probability (the order among
        # equals is each implementation's own)
        probs = torch.softmax(logits.float(), dim=-1)
        assert torch.equal(probs.gather(1, ids.long()), probs.gather(1, want_ids.long()))
        # rounded to bf16 (renormalized here), an exp an ulp apart may round one bf16 ulp off
        torch.testing.assert_close(w, want_w, atol=4e-3 if renormalize else 1e-6, rtol=1e-5)


@pytest.mark.parametrize("tokens", [1, 64, 65])
def test_route_align_one_launch_equals_two(tokens: int) -> None:
    from executor.kernels.moe.align import align
    from executor.kernels.moe.route import route_align, route_topk

    logits = torch.randn(tokens, 128, device="cuda").bfloat16()
    weights, ids, aligned = route_align(logits, 8, True, True, 16)
    want_w, want_ids = route_topk(logits, 8, True, True)
    assert torch.equal(weights, want_w) and torch.equal(ids, want_ids)
    for got, want in zip(aligned, align(want_ids, 128, 16), strict=True):
        assert torch.equal(got, want)


def test_routing_and_experts_never_sync_and_replay_in_a_graph() -> None:
    """route + fused experts under ``set_sync_debug_mode("error")``, then captured in a
    CUDA graph and replayed on new inputs: equal to the eager run on those inputs."""
    from executor.kernels.moe.fused import fused_moe

    w13, w2, router = _experts(QWEN3_30B, 0)
    x = torch.randn(16, QWEN3_30B[2], device="cuda").bfloat16()

    def step() -> torch.Tensor:
        return fused_moe(x, x @ router.t(), w13, w2, 8, True, True)

    step()  # compile the kernels outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in range(3):
        x.copy_(torch.randn(x.shape, device="cuda", generator=torch.Generator(
            device="cuda").manual_seed(seed)))
        graph.replay()
        torch.testing.assert_close(out, step(), atol=0, rtol=0)


MIXTRAL = (8, 2, 4096, 14336)


@pytest.mark.parametrize(("shape", "tokens"), [
    (QWEN3_30B, 1), (QWEN3_30B, 2), (QWEN3_30B, 4), (MIXTRAL, 1), (MIXTRAL, 2),
    (MIXTRAL_TP2, 4)])
def test_decode_path_matches_eager_at_real_shapes(shape: tuple[int, int, int, int],
                                                  tokens: int) -> None:
    """The decode path (``moe.decode``: routing in gate_up, the weighted sum in down)
    against the eager experts on its own routing, that routing against the routing
    kernel's, the same bits on a second run, and its fused norm against the norm kernel
    followed by the path."""
    from executor import kernels
    from executor.kernels.moe import decode
    from executor.kernels.moe.reference import experts_reference
    from executor.kernels.moe.route import route_topk

    w13, w2, router = _experts(shape, tokens)
    x = torch.randn(tokens, shape[2], device="cuda").bfloat16()
    logits = x @ router.t()
    for renormalize in (True, False):
        out, weights, ids = decode.routed(x, logits, w13, w2, shape[1], renormalize,
                                          renormalize)
        want_w, want_ids = route_topk(logits, shape[1], renormalize, renormalize)
        probs = torch.softmax(logits.float(), dim=-1)
        assert torch.equal(probs.gather(1, ids.long()), probs.gather(1, want_ids.long()))
        torch.testing.assert_close(weights, want_w, atol=4e-3, rtol=1e-5)
        want = experts_reference(x, w13, w2, weights, ids)
        torch.testing.assert_close(out.float(), want.float(), atol=3e-2, rtol=3e-2)
        again = decode.routed(x, logits, w13, w2, shape[1], renormalize, renormalize)
        assert all(torch.equal(a, b) for a, b in zip(again, (out, weights, ids), strict=True))
    # a NaN row (a padded graph row, say) routes nowhere: no read past the experts
    nan_out = decode.routed(x, torch.full_like(logits, float("nan")), w13, w2, shape[1], True,
                            True)[0]
    torch.cuda.synchronize()
    assert nan_out.shape == x.shape
    nw = (1.0 + 0.1 * torch.randn(shape[2], device="cuda")).bfloat16()
    summed = 4.0 * x
    got = decode.routed(summed, logits, w13, w2, shape[1], True, True, nw, 1e-6)[0]
    want = decode.routed(kernels.rms_norm(summed, nw, 1e-6), logits, w13, w2, shape[1],
                         True, True)[0]
    print(f"fused norm {shape} x{tokens}: {(got != want).float().mean().item():.4%} differ")
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize(("shape", "fits"), [
    (QWEN3_30B, "3 an SM"), ((64, 4, 1024, 512), "2 an SM"), (MIXTRAL, "no")])
def test_one_launch_equals_two_launches(shape: tuple[int, int, int, int], fits: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """One token's experts in one launch (down in gate_up's grid, behind a device-wide
    arrival counter) give the two launches' bits, output and routing, with and without
    the fused norm, where the grid fits the GPU at once (Mixtral's 896 programs do not:
    two launches); launches of different grid sizes alternate in one process and in one
    CUDA graph replayed several times (each grid size counts its own arrivals)."""
    from executor.kernels.moe import decode
    from executor.kernels.switches import KernelSwitches

    w13, w2, router = _experts(shape, 7)
    x = torch.randn(1, shape[2], device="cuda").bfloat16()
    logits = x @ router.t()
    nw = (1.0 + 0.1 * torch.randn(shape[2], device="cuda")).bfloat16()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiles = decode.pick_tiles(1, shape[1], shape[2], shape[3], torch.bfloat16, sms)
    taken = count_one_launches(monkeypatch)
    for norm in (None, nw):
        got = decode.routed(4.0 * x, logits, w13, w2, shape[1], True, True, norm, 1e-6, tiles)
        with KernelSwitches(moe_one_launch=False):  # the two launches
            want = decode.routed(4.0 * x, logits, w13, w2, shape[1], True, True, norm, 1e-6,
                                 tiles)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    expected = {"3 an SM": sms >= 128, "2 an SM": sms >= 128, "no": False}[fits]
    assert taken == [expected] * 2
    monkeypatch.undo()
    small = (16, 2, 256, 128)
    sw13, sw2, srouter = _experts(small, 8)
    sx = torch.randn(1, small[2], device="cuda").bfloat16()

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        a = decode.routed(x, x @ router.t(), w13, w2, shape[1], True, True)[0]
        b = decode.routed(sx, sx @ srouter.t(), sw13, sw2, small[1], True, True)[0]
        return a, b

    eager = step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(5):
        graph.replay()
        eager = step()
    torch.cuda.synchronize()
    assert all(torch.equal(c, e) for c, e in zip(captured, eager, strict=True))


def test_a_grid_that_never_arrives_fails_instead_of_hanging() -> None:
    """The one-launch spin is bounded: with the arrival counter knocked off a multiple of
    the grid (as a grid that is not resident at once would leave it), the launch fails
    with a CUDA error within seconds (the server then reports a fatal device error and
    is restarted) instead of hanging the GPU. In a subprocess: the error ends its
    context."""
    import subprocess
    import sys
    import time

    script = """
import torch
from executor.kernels.moe import decode, decode_persistent
torch.manual_seed(0)
e, k, h, i = 64, 4, 1024, 512
w13 = (0.05 * torch.randn(e, 2 * i, h, device="cuda")).bfloat16()
w2 = (0.05 * torch.randn(e, h, i, device="cuda")).bfloat16()
x = torch.randn(1, h, device="cuda").bfloat16()
logits = torch.randn(1, e, device="cuda").bfloat16()
taken = []
real = decode_persistent.try_one_launch
def counting(*args, **kwargs):
    taken.append(real(*args, **kwargs))
    return taken[-1]
decode_persistent.try_one_launch = counting
decode.routed(x, logits, w13, w2, k, True, True)
torch.cuda.synchronize()
assert taken == [True], taken
tiles = decode.pick_tiles(1, k, h, i, torch.bfloat16,
                          torch.cuda.get_device_properties(0).multi_processor_count)
grid = k * (i // tiles.block_n)
counter = decode_persistent._counter(x.device, grid)
assert int(counter.item()) == grid
counter.fill_(2 * grid - 1)  # this launch's later arrivals wait for 3 * grid: never
print("launching", flush=True)
decode.routed(x, logits, w13, w2, k, True, True)
torch.cuda.synchronize()
print("returned", flush=True)
"""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[3])
    took = time.monotonic() - start
    assert "launching" in proc.stdout and "returned" not in proc.stdout, proc.stdout
    assert proc.returncode != 0 and "CUDA error" in proc.stderr, proc.stderr[-2000:]
    assert took < 300


@pytest.mark.parametrize("tokens", [1, 2, 4])
def test_decode_path_never_syncs_and_replays_in_a_graph(tokens: int) -> None:
    """``fused_moe`` at decode sizes with the norm fused: no host sync, and a CUDA graph
    replayed on new inputs gives the eager run's bits."""
    from executor.kernels.moe import decode
    from executor.kernels.moe.fused import fused_moe

    assert decode.takes(tokens, 8, 128)
    w13, w2, router = _experts(QWEN3_30B, tokens)
    x = torch.randn(tokens, QWEN3_30B[2], device="cuda").bfloat16()
    nw = (1.0 + 0.1 * torch.randn(QWEN3_30B[2], device="cuda")).bfloat16()

    def step() -> torch.Tensor:
        return fused_moe(x, x @ router.t(), w13, w2, 8, True, True, nw, 1e-6)

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in range(3):
        x.copy_(torch.randn(x.shape, device="cuda", generator=torch.Generator(
            device="cuda").manual_seed(seed)))
        graph.replay()
        torch.testing.assert_close(out, step(), atol=0, rtol=0)


def test_decode_path_with_pdl_equals_plain_launches() -> None:
    """Launched with PDL (each kernel may start while its predecessor finishes) inside a
    CUDA graph, the decode path after a router GEMM gives the plain launches' bits."""
    from executor.kernels import skinny
    from executor.kernels.moe.fused import fused_moe
    from executor.kernels.switches import KernelSwitches, pdl_unsupported_reason

    if pdl_unsupported_reason("cuda"):
        pytest.skip(pdl_unsupported_reason("cuda"))
    w13, w2, router = _experts(QWEN3_30B, 5)
    x = torch.randn(1, QWEN3_30B[2], device="cuda").bfloat16()
    res = torch.randn(1, QWEN3_30B[2], device="cuda").bfloat16()
    nw = (1.0 + 0.1 * torch.randn(QWEN3_30B[2], device="cuda")).bfloat16()

    def step() -> torch.Tensor:
        logits, summed = skinny.skinny_norm_gemm(x, res, nw, 1e-6, router)
        assert summed is not None
        return fused_moe(summed, logits, w13, w2, 8, True, True, nw, 1e-6)

    outs = []
    for on in (False, True):
        with KernelSwitches(pdl=on):
            step()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = step()
            for _ in range(3):
                graph.replay()
            outs.append(out.clone())
    assert torch.equal(outs[0], outs[1])


def _make(path: Path, graphs: bool, quantization: str | None = None,
          moe_one_launch: str = "auto") -> Executor:
    cfg = ExecutorConfig(
        model=ModelConfig(source=str(path), dtype="bfloat16", quantization=quantization),
        device="cuda",
        cache=CacheConfig(kv_tokens=64 * 1024, max_sequences=32, max_context=2048),
        graphs=GraphConfig(decode_mode="full" if graphs else "disabled",
                           prefill_mode="breakable" if graphs else "disabled",
                           decode_buckets=(1, 2, 4, 8, 16), prefill_buckets=PREFILL_BUCKETS),
        attention_backend="triton", max_decode_batch=16, max_prefill_tokens=512,
        moe_one_launch=moe_one_launch)
    return Executor(cfg)


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "qwen3_moe-fp8-block",
                                        "mixtral-fp8-at-load"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[tuple[Executor, Executor]]:
    """(graphs, eager) executors of one model: bf16, an FP8 block-wise checkpoint of it,
    or it quantized at load (``--quantization fp8``): FP8 experts through the kernels.

    NOTE: as in test_fp8_gpu.py, the FP8 projections keep w8a16 at every row count here:
    five sequences decode eagerly at 5 rows but replay the 8-row graph, where a per-channel
    projection would quantize its activations (the FP8 x FP8 kernel) and move logits by
    more than this comparison's margin."""
    from executor.quant import gemm

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gemm, "skinny_kernel", lambda *_: "w8a16")
        yield _pair(request.param, tmp_path_factory)


def _pair(param: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Executor, Executor]:
    kind = param.split("-")[0]
    root = tmp_path_factory.mktemp("moe")
    path, quantization = gpu_moe_model(root, kind), None
    if param.endswith("fp8-block"):
        path = write_fp8_copy(path, root / "fp8", "block")
    elif param.endswith("fp8-at-load"):
        quantization = "fp8"
    ex = _make(path, graphs=True, quantization=quantization)
    if "fp8" in param:
        assert ex.status().model.weight_format == "fp8_e4m3"
        assert type(ex.model.layers[0].mlp.experts).__name__ == "Fp8Experts"  # type: ignore[union-attr, index]
    for phase in ex.capture(["decode", "prefill"]):
        assert phase.buckets and all(b.ok for b in phase.buckets), phase
    return ex, _make(path, graphs=False, quantization=quantization)


def test_fp8_experts_agree_with_their_dequantized_model(tmp_path: Path) -> None:
    """An FP8 block-wise checkpoint served with its experts (and projections) in e4m3
    against the same values dequantized to a bf16 checkpoint: the same clear greedy
    choices through prefill and decode (the kernels dequantize in float32 registers, the
    reference rounds each weight to bf16 once: logits differ by that rounding)."""
    from tests.helpers.fp8_models import write_dequantized

    fp8 = write_fp8_copy(gpu_moe_model(tmp_path, "qwen3_moe"), tmp_path / "fp8", "block")
    ex = _make(fp8, graphs=True)
    for phase in ex.capture(["decode", "prefill"]):
        assert phase.buckets and all(b.ok for b in phase.buckets), phase
    ref = _make(write_dequantized(fp8, tmp_path / "ref"), graphs=False)
    greedy_agrees(ex, ref)


def test_moe_one_launch_switch_serves_the_same_bits(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``--moe-one-launch`` auto against off on one model (bf16 experts): Health names the
    feature only where it is on, the one-token decode steps take the single launch only
    there (in the captured graphs too), and both serve the same tokens and logprobs, bit
    for bit (the single launch keeps the two launches' order and roundings)."""
    from executor.api import DecodeItem, SamplingParams

    taken = count_one_launches(monkeypatch)
    path = gpu_moe_model(tmp_path, "qwen3_moe")
    runs: dict[str, list[tuple[object, ...]]] = {}
    for mode in ("auto", "off"):
        taken.clear()
        ex = _make(path, graphs=True, moe_one_launch=mode)
        assert ("moe_one_launch" in ex.status().model.kernel_features) == (mode == "auto")
        for phase in ex.capture(["decode"]):
            assert phase.buckets and all(b.ok for b in phase.buckets), phase
        params = SamplingParams(logprobs=True, top_logprobs=3)
        out = ex.prefill([PrefillItem("s", rand_tokens(50, 31), sampling=params)]).outputs[0]
        seen = [(out.token_id, out.logprob, tuple(out.top_logprobs))]
        for _ in range(8):
            step = ex.decode([DecodeItem("s", int(out.token_id), params)])  # type: ignore[arg-type]
            assert step.step.path == "graph"
            out = step.outputs[0]
            seen.append((out.token_id, out.logprob, tuple(out.top_logprobs)))
        runs[mode] = seen
        if mode == "auto":
            assert taken and all(taken)
        else:
            assert not taken
        ex.release(["s"])
        del ex
    assert runs["auto"] == runs["off"]


def test_greedy_graphs_equal_eager_without_fallbacks(pair: tuple[Executor, Executor]) -> None:
    """Prefill of five prompts, a continuing prefill, ten decode steps: every step on the
    graph path (``greedy_agrees`` checks each step's path) and the same clear choices."""
    ex, eager = pair
    greedy_agrees(ex, eager)
    ex.kv.check_invariants()


def test_graph_logits_equal_eager(pair: tuple[Executor, Executor]) -> None:
    ex, _ = pair
    compare(ex, {"a": rand_tokens(200, 1), "b": rand_tokens(37, 2), "c": rand_tokens(5, 3)})
    ex.release(["a", "b", "c"])
    last = {o.seq_id: int(o.token_id)  # type: ignore[arg-type]
            for o in ex.prefill([PrefillItem(f"d{i}", rand_tokens(9 + 50 * i, 10 + i))
                                 for i in range(3)]).outputs}
    for _ in range(6):
        alloc = ex.kv.allocate([(s, 1) for s in last])
        decision = ex.forward.decide("decode", len(last))
        assert decision.use_graph and decision.bucket is not None, decision
        graph, eager = graph_and_eager(ex, ex.runners["decode"], "decode", list(last.values()),
                                       alloc, decision.bucket)
        torch.testing.assert_close(graph, eager, atol=LOGIT_ATOL, rtol=LOGIT_RTOL)
        assert_same_greedy(graph, eager)
        last = dict(zip(last, graph.argmax(-1).tolist(), strict=True))
    ex.release(list(last))
    ex.kv.check_invariants()


def test_one_sequence_decode_graph_equals_eager(pair: tuple[Executor, Executor]) -> None:
    """Batch 1 (the decode path, its norm fused into the router GEMM): graph replays
    against eager forwards of the same steps."""
    ex, _ = pair
    last = {o.seq_id: int(o.token_id)  # type: ignore[arg-type]
            for o in ex.prefill([PrefillItem("one", rand_tokens(40, 21))]).outputs}
    for _ in range(6):
        alloc = ex.kv.allocate([(s, 1) for s in last])
        decision = ex.forward.decide("decode", 1)
        assert decision.use_graph and decision.bucket is not None, decision
        graph, eager = graph_and_eager(ex, ex.runners["decode"], "decode", list(last.values()),
                                       alloc, decision.bucket)
        torch.testing.assert_close(graph, eager, atol=LOGIT_ATOL, rtol=LOGIT_RTOL)
        assert_same_greedy(graph, eager)
        last = dict(zip(last, graph.argmax(-1).tolist(), strict=True))
    ex.release(list(last))
    ex.kv.check_invariants()
