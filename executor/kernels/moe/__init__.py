"""The mixture-of-experts block's kernels: routing, the eager reference, the fused path.

``reference`` (plain torch, no Triton): ``route`` (router softmax, top-k, optional
renormalization; device ops, no host sync) and ``experts_reference`` (Hugging Face's loop
over the experts that received tokens: the CPU path and the tests' reference). The fused
path (Triton): ``route`` (the same routing in one launch), ``align`` (the routed (token,
slot) pairs grouped by expert, each run padded to the GEMM's row block, in fixed-size
device buffers: capturable), ``fused`` (two grouped GEMM launches, gate/up with
SiLU-and-mul fused, then down scaled by the routing weights, and the sum of each token's
``top_k`` rows); ``decode`` (a few tokens: two GEMV-style launches, routing in the first,
the top-k sum in the second, the input norm optionally fused); ``scales`` (FP8 expert
weights: per-channel or 128x128 block scales, checked). Why it is shaped so:
``docs/kernels.md``. Only ``reference`` and ``scales`` import without Triton.
"""
