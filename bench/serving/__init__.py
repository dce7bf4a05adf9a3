"""The service around the executor: gRPC overhead, what a scheduler waits per token, and
the host work of a step, on a GPU or a simulated device."""
