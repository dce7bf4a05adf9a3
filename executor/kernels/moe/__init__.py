"""The mixture-of-experts block's kernels: routing, the eager reference, the fused path.

``reference`` (plain torch, no Triton): ``route`` (router softmax, top-k, optional
renormalization; on the device, no host sync) and ``experts_reference`` (Hugging Face's
loop over the experts that received tokens: the CPU path and the tests' reference).
``route`` is the same routing in one Triton launch (the fused path's). ``align`` groups the routed (token, expert) pairs by expert, each expert's rows padded to
the GEMM's block height, into fixed-size device buffers (capturable). ``fused`` runs the
experts as two grouped GEMM launches (gate/up with SiLU-and-mul fused, then down scaled by
the routing weights) and sums each token's ``top_k`` rows. Why it is shaped so:
``docs/kernels.md``. ``align`` and ``fused`` import Triton; ``reference`` does not.
"""
