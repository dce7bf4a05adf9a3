"""End to end: what a step, a KV primitive or a tensor-parallel server costs through the
executor or a real server."""
