"""Benchmarks, grouped by the question they answer; ``bench/README.md`` lists every entry
point, how to run it and where its output goes."""
