"""Dtype names shared by the attention registry (light, no torch) and the backends."""

#: The activation/KV dtypes the kernel backends (Triton, FlashInfer) support.
KERNEL_DTYPE_NAMES = ("float16", "bfloat16")
