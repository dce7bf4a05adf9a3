"""CUDA graphs: buckets and the graph-or-eager decision (pure), runners and backends."""
