"""The L2 policy of the weights a decode step streams (``STREAM``).

At a few rows a decode step reads every weight once, and one layer's stream (a large dense
MLP, a sparse layer's routed experts) is as large as the L2 or larger. Under the default
policy that stream pushes out the small lines the step reads again within microseconds:
the activations, residual and scratch one kernel writes and the next one reads (the MoE
activations gate_up writes and down reads after its grid-wide wait; the residual a GEMM's
first program writes at the start of its stream). Those reads then go to HBM, on the
latency-bound path between kernels. The decode kernels (the skinny GEMMs, the FP8 one-row
kernel, the MoE decode path) therefore load their weights ``evict_first``: Triton emits an
L2 ``evict_first`` cache policy (and the L1 hint), so the weights pass through and the hot
lines stay. Kernels whose programs may read one weight tile more than once (the prefill
GEMMs, the grouped MoE, the FP8 kernel with a grid over row blocks) keep the default.
Numerics are untouched.
"""

from __future__ import annotations

import triton.language as tl

#: ``eviction_policy`` of a weight load that reads each element once per launch.
STREAM: tl.constexpr = tl.constexpr("evict_first")
