"""What the benchmarks share: the CUDA-graph timer, the gRPC client, run metadata, model
shapes, device measurements, kernel switches, and the report and plots of ``bench.e2e.run``.
Entry points import only from here and from the executor."""
