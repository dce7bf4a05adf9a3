"""Single kernels and layers against what they replace (GEMM libraries, the skinny GEMM
and its tile tuner, decode attention, the fused layer kernels)."""
