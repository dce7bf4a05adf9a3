"""Experiment: decode attention at batch 1-8, context 512/2048: the shipped split+reduce
against one split per sequence with a wide key block (one iteration for 512 tokens).
Each timed inside a CUDA graph of 16 launches (layers) with PDL off. Not committed."""
import math, statistics, sys, torch, triton
from executor.attention.triton_kernels import decode as d
dev = torch.device("cuda")
sms = torch.cuda.get_device_properties(dev).multi_processor_count

def setup(B, H, KV, ctx, D=64, max_ctx=4096):
    g = torch.Generator(device=dev).manual_seed(0)
    locs = B * max_ctx + 1
    kp = torch.randn(locs, KV, D, device=dev, dtype=torch.bfloat16, generator=g)
    vp = torch.randn(locs, KV, D, device=dev, dtype=torch.bfloat16, generator=g)
    table = torch.arange(1, locs, device=dev, dtype=torch.int32).view(B, max_ctx).contiguous()
    lens = torch.full((B,), ctx, device=dev, dtype=torch.int64)
    rows = torch.arange(B, device=dev)
    loc = table[rows, lens - 1].long()
    q = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16, generator=g)
    kn = torch.randn(B, KV, D, device=dev, dtype=torch.bfloat16, generator=g)
    vn = torch.randn(B, KV, D, device=dev, dtype=torch.bfloat16, generator=g)
    return kp, vp, table, lens, rows, loc, q, kn, vn

def shipped(args, B, H, KV, max_ctx):
    kp, vp, table, lens, rows, loc, q, kn, vn = args
    s = d.num_kv_splits(B, KV, max_ctx, sms)
    out = torch.empty_like(q)
    mo = torch.empty(B, H, s, 64, device=dev); ml = torch.empty(B, H, s, device=dev)
    return (lambda: d.decode_attention(q, kn, vn, kp, vp, table, rows, lens, loc, out, mo, ml, 0.125)), out, s

def oneshot(args, B, H, KV, block_n, warps, stages):
    kp, vp, table, lens, rows, loc, q, kn, vn = args
    out = torch.empty_like(q)
    group = H // KV
    def run():
        d._decode_split_kernel[(B, KV, 1)](
            q, kn, vn, kp, vp, table, rows, lens, loc, out, out, out, out, out, 0,
            0.125 * math.log2(math.e), group, 1,
            q.stride(0), q.stride(1), kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1),
            kp.stride(0), kp.stride(1), table.stride(0), 0, 0, 0, 0, 0, out.stride(0), out.stride(1),
            HEAD_DIM=64, BLOCK_D=64, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
            SPLIT_ALIGN=32, WRITE_OUT=True, ROPE=False, USE_PDL=False, num_warps=warps, num_stages=stages)
    return run, out

def t(fn):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(16): fn()
    ts = []
    for _ in range(30):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) * 1000 / 16)
    return statistics.median(ts)

for (name, H, KV) in (("1b", 32, 8), ("smollm2", 9, 3)):
    for B in (1, 8):
        for ctx in (512, 2048):
            args = setup(B, H, KV, ctx)
            fn, ref, s = shipped(args, B, H, KV, 4096)
            base = t(fn); want = ref.clone()
            line = f"{name} B={B} ctx={ctx}: shipped ({s} splits) {base:.2f} us"
            for bn, w, st in ((512, 8, 1), (512, 4, 1), (256, 8, 2), (256, 4, 2), (128, 4, 2)):
                try:
                    fn2, out2 = oneshot(args, B, H, KV, bn, w, st)
                    us = t(fn2)
                    err = (out2.float() - want.float()).abs().max().item()
                    line += f" | 1 split BLOCK_N {bn} w{w} s{st}: {us:.2f} ({err:.2g})"
                except Exception as exc:
                    line += f" | {bn} w{w}: {type(exc).__name__} {str(exc)[:60]}"
            print(line, flush=True)
