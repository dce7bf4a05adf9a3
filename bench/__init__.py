"""Benchmarks (GPU): see bench/README.md."""
