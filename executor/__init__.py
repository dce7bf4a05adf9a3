"""model-executor's device side: model, KV cache, attention, graphs, sampling."""

__version__ = "0.1.0"
