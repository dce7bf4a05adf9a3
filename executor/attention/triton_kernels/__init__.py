"""Triton kernels of the paged attention backend (one concept per module).

* ``store``: fused write of a layer's new K and V rows at their cache locations.
* ``decode``: split-KV decode with a log-sum-exp reduction; its launch shape never
  depends on sequence lengths, so it can be captured in a CUDA graph.
* ``extend``: packed variable-length prefill/extend over a cached prefix.
* ``scores``: base-2 scores, soft-capped where the model caps them.
"""

from executor.attention.triton_kernels.decode import decode_attention, num_kv_splits
from executor.attention.triton_kernels.extend import (
    extend_attention,
    extend_attention_fixed_grid,
)
from executor.attention.triton_kernels.store import store_kv

__all__ = ["decode_attention", "extend_attention", "extend_attention_fixed_grid",
           "num_kv_splits", "store_kv"]
