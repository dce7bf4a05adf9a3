"""The loader's FP8 steps: projections swapped in before the weights load, finished after.

``install`` (on the meta-device model, checkpoint formats): each decoder projection the
checkpoint quantized becomes an ``Fp8Linear``, each sparse layer's experts ``Fp8Experts``;
a tensor-parallel size that would cut a 128x128 block is refused first.
``quantize_at_load`` (``--quantization fp8``): the loaded projections and experts quantized
per output row. ``finalize``: on a GPU with FP8 each layer gets its GEMM
(``gemm.prepare``; the experts the fused MoE kernels); elsewhere (CPU, compute capability
< 8.9, float32 serving) each is replaced by its dequantized ``nn.Linear`` (``Experts``),
once. Either way the model records a ``QuantInfo`` (Health, the start-up log line).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from executor.errors import ConfigError, ModelLoadError
from executor.model.spec import ModelSpec
from executor.quant.experts import Fp8Experts, check_expert_blocks
from executor.quant.linear import Fp8Linear
from executor.quant.scheme import Fp8Scheme

_log = logging.getLogger("executor.quant")
#: Our fused projection -> the checkpoint modules fused into it, and the dimension tensor
#: parallelism cuts it along.
PROJECTIONS: dict[str, tuple[tuple[str, ...], int]] = {
    "self_attn.qkv_proj": (("q_proj", "k_proj", "v_proj"), 0),
    "self_attn.o_proj": (("o_proj",), 1),
    "mlp.gate_up_proj": (("gate_proj", "up_proj"), 0),
    "mlp.down_proj": (("down_proj",), 1),
}
_ATTR = "quant_info"
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


@dataclass(frozen=True)
class QuantInfo:
    """What Health and the start-up log say about the projections' weights.

    ``weight_format``: how they are held on the device: ``fp8_e4m3``, or the serving
    dtype where they were dequantized at load (or never quantized). ``quantization``: the
    scheme's name (``Fp8Scheme.name``), "" for none. ``paths``: projection kind -> GEMM.
    """

    weight_format: str
    quantization: str = ""
    paths: dict[str, str] = field(default_factory=dict)

    @property
    def dequantized(self) -> bool:
        return bool(self.quantization) and self.weight_format != "fp8_e4m3"


def info_of(model: object, dtype: torch.dtype) -> QuantInfo:
    """The model's ``QuantInfo`` (an unquantized model's: its dtype, no scheme)."""
    info = getattr(model, _ATTR, None)
    return info if isinstance(info, QuantInfo) else QuantInfo(_DTYPE_NAMES.get(dtype, str(dtype)))


def _projections(model: nn.Module, kind: type[nn.Module]
                 ) -> Iterator[tuple[str, str, nn.Module, str, nn.Module]]:
    """(name, ``PROJECTIONS`` key, parent, attribute, module) of every decoder projection."""
    for name, module in list(model.named_modules()):
        if type(module) is not kind:
            continue
        for suffix in PROJECTIONS:
            if name.endswith("." + suffix):
                parent_name, _, attr = name.rpartition(".")
                yield name, suffix, model.get_submodule(parent_name), attr, module


def _shards(kind: str, spec: ModelSpec, out_features: int) -> tuple[int, ...]:
    if kind == "qkv_proj":
        return (spec.q_size, spec.kv_size, spec.kv_size)
    if kind == "gate_up_proj":
        return (spec.intermediate_size, spec.intermediate_size)
    return (out_features,)


def check_blocks(scheme: Fp8Scheme, spec: ModelSpec, tp_size: int) -> None:
    """Refuse block scales that the fused shards or this tensor-parallel size would cut
    (``spec`` is one rank's shape), in one line with the sizes that keep whole blocks."""
    if scheme.block is None:
        return
    bn, bk = scheme.block

    def cut(q: int, kv: int, inter: int, size: int) -> list[str]:
        out = [f"{n} {v} rows" for n, v in (("q", q), ("k/v", kv), ("gate/up", inter))
               if v % bn]
        if size > 1:
            out += [f"{n} {v} columns" for n, v in (("o_proj", q), ("down_proj", inter))
                    if v % bk]
        return out

    q, kv, inter = spec.q_size, spec.kv_size, spec.intermediate_size
    bad = cut(q, kv, inter, tp_size)
    if not bad:
        return
    heads = spec.num_heads * tp_size, spec.num_kv_heads * tp_size
    ok = [n for n in range(1, heads[1] + 1) if heads[0] % n == 0 and heads[1] % n == 0
          and (inter * tp_size) % n == 0
          and not cut(q * tp_size // n, kv * tp_size // n, inter * tp_size // n, n)]
    what = f"--tensor-parallel-size {tp_size}" if tp_size > 1 else "this model's fused layout"
    raise ConfigError(f"{what} would cut the checkpoint's {bn}x{bk} FP8 weight blocks "
                      f"(per rank: {', '.join(bad)}); sizes that keep whole blocks: "
                      f"{', '.join(map(str, ok)) or 'none'}")


def install(model: nn.Module, scheme: Fp8Scheme, spec: ModelSpec, tp_size: int) -> None:
    """Swap the projections (and experts) the checkpoint quantized for ``Fp8Linear`` (and
    ``Fp8Experts``) (call on the meta device, before ``materialize``)."""
    check_blocks(scheme, spec, tp_size)
    install_experts(model, scheme, tp_size)
    for name, key, parent, attr, module in _projections(model, nn.Linear):
        sources, split = PROJECTIONS[key]
        kind = key.rpartition(".")[2]
        prefix = "model." + name.rpartition(".")[0] + "."
        ignored = [scheme.ignores(prefix + s) for s in sources]
        if all(ignored):
            continue
        if any(ignored):
            raise ModelLoadError(f"{scheme.source}: {prefix}{{{','.join(sources)}}} are "
                                 "quantized only in part; we fuse them, so all or none must be")
        assert isinstance(module, nn.Linear)
        setattr(parent, attr, Fp8Linear(module.in_features, module.out_features, scheme,
                                        _shards(kind, spec, module.out_features), split,
                                        module.bias is not None))


def _experts(model: nn.Module, kind: type[nn.Module]
             ) -> Iterator[tuple[str, nn.Module, str, nn.Module]]:
    """(name, parent, attribute, module) of every sparse layer's experts of type ``kind``."""
    for name, module in list(model.named_modules()):
        if type(module) is kind and name.endswith(".mlp.experts"):
            parent_name, _, attr = name.rpartition(".")
            yield name, model.get_submodule(parent_name), attr, module


def _experts_ignored(scheme: Fp8Scheme, name: str) -> bool:
    """Whether the checkpoint left the experts of ``layers.L.mlp.experts`` unquantized
    (by their published per-expert names, Qwen3-MoE's or Mixtral's)."""
    layer = name.split(".")[1]
    return any(scheme.ignores(f"model.layers.{layer}.{block}.experts.0.{proj}")
               for block, proj in (("mlp", "gate_proj"), ("block_sparse_moe", "w1")))


def install_experts(model: nn.Module, scheme: Fp8Scheme, tp_size: int) -> None:
    """Swap each sparse layer's experts for ``Fp8Experts`` where the checkpoint quantized
    them (call on the meta device, before ``materialize``)."""
    from executor.model.moe import Experts

    for name, parent, attr, module in _experts(model, Experts):
        if _experts_ignored(scheme, name):
            continue
        w13: torch.Tensor = module.gate_up_proj  # type: ignore[assignment]
        e, two_i, hidden = w13.shape
        check_expert_blocks(scheme, two_i // 2, tp_size)
        setattr(parent, attr, Fp8Experts(e, two_i // 2, hidden, scheme))


def quantize_at_load(model: nn.Module, scheme: Fp8Scheme, spec: ModelSpec) -> None:
    """``--quantization fp8``: every loaded projection and expert quantized per output row."""
    from executor.model.moe import Experts

    for _name, key, parent, attr, module in _projections(model, nn.Linear):
        split, kind = PROJECTIONS[key][1], key.rpartition(".")[2]
        assert isinstance(module, nn.Linear)
        setattr(parent, attr, Fp8Linear.quantize(
            module, scheme, _shards(kind, spec, module.out_features), split))
        del module  # its storage goes back before the next layer's is quantized
    for _name, parent, attr, module in _experts(model, Experts):
        setattr(parent, attr, Fp8Experts.quantize(module, scheme))
        del module


def finalize(model: nn.Module, scheme: Fp8Scheme, dtype: torch.dtype,
             device: torch.device) -> QuantInfo:
    """Give every ``Fp8Linear`` its GEMM, or replace it by its dequantized ``nn.Linear``
    where this device cannot run FP8; record and return the ``QuantInfo``."""
    from executor.quant import gemm

    keep = gemm.fp8_supported(device) and dtype in (torch.bfloat16, torch.float16)
    paths: dict[str, str] = {}
    for _name, key, parent, attr, module in _projections(model, Fp8Linear):
        kind = key.rpartition(".")[2]
        assert isinstance(module, Fp8Linear)
        if keep:
            gemm.prepare(module)
            paths[kind] = module.path
        else:
            setattr(parent, attr, module.to_linear(dtype))
            paths[kind] = f"dequantized at load to {_DTYPE_NAMES.get(dtype, dtype)}"
    for _name, parent, attr, module in _experts(model, Fp8Experts):
        assert isinstance(module, Fp8Experts)
        if keep:
            paths["experts"] = "triton_fused_moe_w8a16"
        else:
            setattr(parent, attr, module.to_experts(dtype))
            paths["experts"] = f"dequantized at load to {_DTYPE_NAMES.get(dtype, dtype)}"
    why = "" if keep else (" (no FP8 on this device)" if dtype != torch.float32
                           else " (float32 serving)")
    info = QuantInfo("fp8_e4m3" if keep else _DTYPE_NAMES.get(dtype, str(dtype)),
                     scheme.name, paths)
    setattr(model, _ATTR, info)
    if device.type == "cuda":
        # NOTE: the replaced weights (bf16 before --quantization, FP8 before a dequantize)
        # go back to the device, not only to torch's cache: the KV cache is sized from the
        # device's free memory next.
        torch.cuda.empty_cache()
    _log.debug("fp8 %s%s", scheme.name, why)
    return info
