"""Load a Hugging Face model directory into the model family its config names.

Reads ``config.json`` with transformers' ``AutoConfig`` and streams tensors from
``*.safetensors`` (sharded or not, with or without an index file) straight into our
modules, fusing q/k/v and gate/up on the way. No HF model is ever instantiated. Every
parameter must be filled exactly once with the expected shape; otherwise a
``ModelLoadError`` says which tensor and what was expected.

``load_format="random"`` (vLLM's ``--load-format dummy``) reads only ``config.json`` and
draws every tensor on the device (``random_weights.RandomCheckpoint``): for benchmarks of
shapes too large to write to disk here. The same loop fills the model, so sharding and
the every-tensor-once check are the same.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

import executor.model.gemma  # registers the Gemma family
import executor.model.llama  # (registers the Llama family)
import executor.model.moe  # noqa: F401 (registers the mixture-of-experts families)
from executor import quant
from executor.config import LoadFormat
from executor.distributed.group import TensorParallel
from executor.errors import ModelLoadError
from executor.model.base import CausalModel, LoadableModel, model_factory
from executor.model.spec import ModelSpec, spec_from_hf_config
from executor.quant import Fp8Linear, Fp8Scheme
from executor.quant.experts import Fp8Experts
from executor.weights import experts
from executor.weights.sharding import copy_fused_shard, copy_shard

# HF names of the shards that we fuse into one parameter, with their shard index.
_FUSED: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_FUSED_RE = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.")
# Tensors some checkpoints carry that we recompute or do not need.
_IGNORED_RE = re.compile(r"rotary_emb\.inv_freq$")


def load_hf_config(path: Path) -> ModelSpec:
    return spec_from_hf_config(_hf_config(path))


def _hf_config(path: Path) -> Any:
    from transformers import AutoConfig

    if not path.is_dir():
        raise ModelLoadError(f"model directory {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{str(path)!r} has no config.json; expected a Hugging Face "
                             "model directory (config.json + *.safetensors)")
    try:
        cfg = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers raises many types for a bad config
        raise ModelLoadError(f"cannot parse {path / 'config.json'}: {exc}") from exc
    return cfg


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [path / f for f in sorted(set(weight_map.values()))]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index.name} lists missing shard(s): {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files and (path / "RANDOM_SHAPE").is_file():  # catalog.RANDOM_SHAPE_MARKER
        raise ModelLoadError((path / "RANDOM_SHAPE").read_text().strip())
    if not files:
        raise ModelLoadError(f"{str(path)!r} has no *.safetensors weights (only safetensors "
                             "checkpoints are supported)")
    return files


def _internal_name(hf_name: str) -> tuple[str, int | None]:
    """``model.layers.3.self_attn.k_proj.weight`` -> (``layers.3.self_attn.qkv_proj.weight``, 1)."""
    name = hf_name.removeprefix("model.")
    match = _FUSED_RE.search(name)
    if match is None:
        return name, None
    fused, shard = _FUSED[match.group(1)]
    return name.replace(f".{match.group(1)}.", f".{fused}."), shard


def _shard_rows(spec: ModelSpec, param_name: str) -> list[int]:
    """Row offsets of each shard inside a fused parameter."""
    if ".qkv_proj." in param_name:
        return [0, spec.q_size, spec.q_size + spec.kv_size, spec.q_size + 2 * spec.kv_size]
    return [0, spec.intermediate_size, 2 * spec.intermediate_size]


def _is_fused(param_name: str) -> bool:
    return ".qkv_proj." in param_name or ".gate_up_proj." in param_name


def _expected_sources(model: LoadableModel, spec: ModelSpec) -> set[tuple[str, int | None]]:
    """Every (parameter, shard) the checkpoint must provide."""
    out: set[tuple[str, int | None]] = set()
    for name, param in model.named_parameters():
        if spec.tie_word_embeddings and name == "lm_head.weight":
            continue
        stacked = experts.expected_keys(name, param)
        if stacked is not None:
            out.update(stacked)
        elif spec.features.fused_checkpoint:  # stored as we hold it: one tensor each
            out.add((name, None))
        elif ".qkv_proj." in name:
            out.update((name, i) for i in range(3))
        elif ".gate_up_proj." in name:
            out.update((name, i) for i in range(2))
        else:
            out.add((name, None))
    return out


def _readers(path: Path, files: list[Path] | None, seed: int, device: torch.device
             ) -> Iterator[tuple[Any, str]]:
    """(reader, its name in errors) for each weight file, or without ``files`` the one
    random checkpoint."""
    if files is None:
        from executor.weights.random_weights import RandomCheckpoint

        yield RandomCheckpoint(_hf_config(path), seed, device), "random weights"
        return
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            yield f, file.name


def _load_expert_scale(reader: Any, hf_name: str, scale: tuple[experts.ExpertSource, str],
                       fp8_experts: dict[str, Fp8Experts], scheme: Fp8Scheme | None,
                       spec: ModelSpec, tp: TensorParallel, where: str) -> None:
    """An FP8 expert's scale into its layer's ``Fp8Experts`` (a static ``input_scale`` is
    read past: the experts multiply in w8a16)."""
    src, kind = scale
    module = fp8_experts.get(src.param.rpartition(".")[0])
    if module is None or scheme is None or kind not in (scheme.scale_name, "input_scale"):
        hint = scheme.misplaced(hf_name) if scheme is not None else ""
        raise ModelLoadError(f"unexpected tensor {hf_name!r} in {where} for "
                             f"{spec.architecture}{hint}")
    if kind != "input_scale":
        assert src.expert is not None
        with torch.no_grad():
            module.load_scale(reader, hf_name, src.expert, src.part, tp.rank, tp.size, where)


def _finish_fp8(model: torch.nn.Module, scheme: Fp8Scheme, spec: ModelSpec,
                dtype: torch.dtype, device: torch.device) -> None:
    if scheme.at_load:
        quant.quantize_at_load(model, scheme, spec)
    quant.finalize(model, scheme, dtype, device)


def load_model(path: Path, dtype: torch.dtype, device: torch.device, max_context: int,
               spec: ModelSpec | None = None, tp: TensorParallel | None = None,
               load_format: LoadFormat = "safetensors", seed: int = 0,
               quantization: str | None = None) -> tuple[CausalModel, ModelSpec]:
    """Build the model for ``path`` on ``device`` in ``dtype`` and fill it from safetensors
    (or, ``load_format="random"``, from random values drawn with ``seed``).

    Under tensor parallelism ``spec`` is this rank's shape (``sharding.local_spec``) and
    only this rank's slice of each split tensor is read (``sharding.copy_shard``). FP8
    weights (the checkpoint's ``quantization_config``, or ``quantization="fp8"``) load
    into ``executor.quant.Fp8Linear`` projections (``executor/quant``)."""
    spec = spec or load_hf_config(path)  # callers that already parsed the config pass it
    spec.check_servable(max_context)
    # (a directory without weights fails here, before the model is built)
    files = _weight_files(path) if load_format == "safetensors" else None
    scheme = quant.read_scheme(quant.quantization_config(path, _hf_config(path)), quantization)
    factory = model_factory(spec.architecture)
    tp = tp or TensorParallel.single()
    with torch.device("meta"):
        model = factory(spec, max_context) if not tp.distributed \
            else factory(spec, max_context, tp=tp)  # type: ignore[call-arg]
    if scheme is not None and not scheme.at_load:
        if load_format == "random":
            raise ModelLoadError(f"--load-format random draws unquantized weights; this "
                                 f"config is {scheme.source}: use --quantization fp8 on an "
                                 "unquantized config instead")
        if spec.features.fused_checkpoint and tp.size > 1:
            raise ModelLoadError(f"{spec.architecture}: FP8 weights stored fused (qkv_proj, "
                                 "gate_up_proj) are not split per part under tensor "
                                 "parallelism; serve them with --tensor-parallel-size 1")
        quant.install(model, scheme, spec, tp.size)  # type: ignore[arg-type]
    model.materialize(dtype, device)
    fp8 = {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}  # type: ignore[attr-defined]
    fp8_experts = {n: m for n, m in model.named_modules()  # type: ignore[attr-defined]
                   if isinstance(m, Fp8Experts)}
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = _expected_sources(model, spec)
    loaded: set[tuple[str, int | None]] = set()
    for f, where in _readers(path, files, seed, device):
        for hf_name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            if _IGNORED_RE.search(hf_name) or (scheme is not None and scheme.skips(hf_name)):
                continue
            scale = experts.match_scale(experts.canonical(hf_name))
            if scale is not None:  # an FP8 expert's scale
                _load_expert_scale(f, hf_name, scale, fp8_experts, scheme, spec, tp, where)
                if scale[1] != "input_scale":
                    loaded.update(scale[0].keys(params[scale[0].param].shape[0]))
                continue
            expert = experts.match(experts.canonical(hf_name))
            if expert is not None:  # a stacked experts parameter's slice
                if expert.param not in params:
                    raise ModelLoadError(
                        f"unexpected tensor {hf_name!r} in {where} for {spec.architecture}")
                with torch.no_grad():
                    experts.copy_expert(f, hf_name, expert, params[expert.param], tp.rank,
                                        tp.size, where)
                loaded.update(expert.keys(params[expert.param].shape[0]))
                continue
            name, shard = _internal_name(experts.canonical(hf_name))
            if spec.tie_word_embeddings and name == "lm_head.weight":
                continue  # a tied checkpoint may still carry a copy
            if name not in params:
                hint = scheme.misplaced(hf_name) if scheme is not None else ""
                raise ModelLoadError(f"unexpected tensor {hf_name!r} in {where} for "
                                     f"{spec.architecture}{hint}")
            owner, _, pname = name.rpartition(".")
            if owner in fp8:  # an FP8 projection loads its weight and scales itself
                with torch.no_grad():
                    fp8[owner].load(f, hf_name, pname, shard, tp.rank, tp.size, where)
                loaded.add((name, shard))
                continue
            target: torch.Tensor = params[name]
            if shard is not None:
                rows = _shard_rows(spec, name)
                target = target[rows[shard] : rows[shard + 1]]
            with torch.no_grad():
                if shard is None and _is_fused(name):  # stored fused: cut per part
                    copy_fused_shard(f, hf_name, target, _shard_rows(spec, name), tp.rank,
                                     tp.size, where)
                else:
                    copy_shard(f, hf_name, name, target, tp.rank, tp.size, where)
            loaded.add((name, shard))
    missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in expected - loaded)
    if missing:
        more = f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""
        shown = ", ".join(missing[:8]) + more
        raise ModelLoadError(f"checkpoint at {str(path)!r} is missing tensors: {shown}")
    if scheme is not None:
        _finish_fp8(model, scheme, spec, dtype, device)  # type: ignore[arg-type]
    model.eval().requires_grad_(False)
    return model, spec
