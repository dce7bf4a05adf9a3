"""Where weights come from, apart from the model code that uses them.

    loader          a Hugging Face directory (config + safetensors) into a model's modules
    sharding        which slice of each weight a tensor-parallel rank holds; per-rank shape
    experts         mixture-of-experts checkpoint names into the stacked experts (and slices)
    catalog         named models (``--model smollm2-135m``): fetched, converted, cached;
                    random shapes (``--model qwen3-30b-a3b --load-format random``)
    gguf            GGUF tensors into the Hugging Face layout
    random_weights  random weights of any shape (``--load-format random``)
    tiny            the small model written on first use (``--model tiny``)
    update          new weights in place: the served layout, the whole-source check
    transfer        a trainer's process group, the bucket plan (both sides use it)
    control         the weight version, updates, the trainer's group, sleep (per rank)

The face's names import their module on first use (``__getattr__``): the model code imports
``executor.weights.sharding``, which runs this file first, and an eager import of the
loader here (which imports the model families) would make that a circular import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from executor.weights.catalog import (
        NAMED_MODELS,
        cached_model_dir,
        converted_dir,
        ensure_named_model,
        model_name,
        resolve_model_source,
    )
    from executor.weights.loader import load_hf_config, load_model
    from executor.weights.sharding import check_divisible, local_spec
    from executor.weights.tiny import default_cache_dir
    from executor.weights.transfer import (
        TransferConfig,
        TransferGroup,
        pack_bucket,
        plan_buckets,
    )
    from executor.weights.update import TensorMeta, dtype_name, parse_dtype

_FACE = {
    "NAMED_MODELS": "catalog", "cached_model_dir": "catalog", "converted_dir": "catalog",
    "ensure_named_model": "catalog", "model_name": "catalog",
    "resolve_model_source": "catalog", "load_hf_config": "loader", "load_model": "loader",
    "check_divisible": "sharding", "local_spec": "sharding", "default_cache_dir": "tiny",
    "TransferConfig": "transfer", "TransferGroup": "transfer", "pack_bucket": "transfer",
    "plan_buckets": "transfer", "TensorMeta": "update", "dtype_name": "update",
    "parse_dtype": "update"}
__all__ = ["NAMED_MODELS", "TensorMeta", "TransferConfig", "TransferGroup",
           "cached_model_dir", "check_divisible", "converted_dir", "default_cache_dir",
           "dtype_name", "ensure_named_model", "load_hf_config", "load_model", "local_spec",
           "model_name", "pack_bucket", "parse_dtype", "plan_buckets",
           "resolve_model_source"]


def __getattr__(name: str) -> Any:
    if name not in _FACE:
        raise AttributeError(f"module 'executor.weights' has no attribute {name!r}")
    return getattr(importlib.import_module(f"executor.weights.{_FACE[name]}"), name)
