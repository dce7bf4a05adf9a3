"""Which FP8 weight format a checkpoint uses, read from its ``quantization_config``.

``read_scheme`` turns ``config.json``'s ``quantization_config`` (or ModelOpt's
``hf_quant_config.json``) and ``--quantization`` into one ``Fp8Scheme``, or None for an
unquantized checkpoint served as is. Everything else is refused here, at start-up, in one
line naming the format and what is supported. Formats (tensor layouts: docs/quantization.md):

* ``fp8_block``: ``quant_method: fp8`` with ``weight_block_size`` (Qwen3-FP8, DeepSeek), or
  compressed-tensors ``strategy: block``: one float32 scale per 128x128 weight block.
* ``fp8_per_channel``: compressed-tensors ``FP8_DYNAMIC``: one scale per output row.
* ``fp8_per_tensor``: compressed-tensors ``strategy: tensor``, ModelOpt ``FP8``, or
  ``quant_method: fp8`` without blocks: one weight scale (and a static input scale) per tensor.
* ``--quantization fp8``: an unquantized checkpoint quantized per channel at load.
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from executor.errors import ModelLoadError

QuantKind = Literal["fp8_block", "fp8_per_channel", "fp8_per_tensor"]
#: Values of ``--quantization`` (None: the checkpoint's own format, if any).
QUANTIZATION_CHOICES = ("fp8",)
#: The only block shape served (every published block-wise FP8 checkpoint uses it).
BLOCK = (128, 128)
SUPPORTED = ("quant_method 'fp8' (weight_block_size [128, 128], or per-tensor), "
             "'compressed-tensors' float-quantized 8-bit float weights (strategy channel, "
             "tensor or block [128, 128]), 'modelopt' quant_algo FP8, or --quantization fp8 "
             "on an unquantized checkpoint")
# Checkpoint tensors of KV-cache or attention quantization: the KV cache stays in the
# serving dtype, so they are read past.
_KV_SCALE_RE = re.compile(r"\.(k_scale|v_scale|kv_scale|q_scale|prob_scale)$")


@dataclass(frozen=True)
class Fp8Scheme:
    """How the projections' weights are stored, and what Health calls it.

    ``scale_name``: the checkpoint's name of the weight scale tensor beside each ``weight``
    (``weight_scale_inv`` for ``quant_method: fp8`` blocks; a multiplier despite the name).
    ``static_input``: per-tensor ``input_scale`` tensors are present and used.
    ``at_load``: ``--quantization fp8``: the checkpoint is unquantized; weights are
    quantized per channel after loading. ``ignore``: module patterns the checkpoint left
    unquantized (exact names, ``re:`` regexes, ModelOpt wildcards).
    """

    kind: QuantKind
    name: str  # Health's ``quantization``
    source: str  # the format as the checkpoint names it, for errors and logs
    scale_name: str = "weight_scale"
    block: tuple[int, int] | None = None
    static_input: bool = False
    at_load: bool = False
    ignore: tuple[str, ...] = ()

    def ignores(self, hf_module: str) -> bool:
        """Whether the checkpoint left ``hf_module`` (e.g. ``model.layers.0.mlp.down_proj``)
        unquantized."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], hf_module):
                    return True
            elif pattern == hf_module or fnmatch.fnmatchcase(hf_module, pattern) \
                    or hf_module.endswith("." + pattern):
                return True
        return False

    def misplaced(self, hf_name: str) -> str:
        """What to add to the loader's "unexpected tensor" error for an FP8 scale of a
        module we do not quantize."""
        if not re.search(r"\.(weight_scale|weight_scale_inv|input_scale)$", hf_name):
            return ""
        return (f" ({self.source} quantized a module that takes no FP8 here: only the "
                "decoder's attention and MLP projections and the MoE experts do; the "
                "router and the LM head do not)")

    @staticmethod
    def skips(hf_name: str) -> bool:
        """Checkpoint tensors the loader reads past (KV-cache scales)."""
        return _KV_SCALE_RE.search(hf_name) is not None


AT_LOAD = Fp8Scheme("fp8_per_channel", "fp8_at_load", "--quantization fp8", at_load=True)


def _refuse(what: str) -> ModelLoadError:
    return ModelLoadError(f"unsupported quantization: {what}; supported: {SUPPORTED}")


def quantization_config(model_dir: Path, hf_config: Any) -> dict[str, Any] | None:
    """The checkpoint's quantization config: ``config.json``'s ``quantization_config``,
    else ModelOpt's ``hf_quant_config.json`` (as ``{"quant_method": "modelopt", ...}``)."""
    qcfg = getattr(hf_config, "quantization_config", None)
    if qcfg is not None and not isinstance(qcfg, dict):
        qcfg = qcfg.to_dict() if hasattr(qcfg, "to_dict") else dict(vars(qcfg))
    if qcfg:
        return dict(qcfg)
    modelopt = model_dir / "hf_quant_config.json"
    if modelopt.is_file():
        raw = json.loads(modelopt.read_text())
        inner = raw.get("quantization", {}) if isinstance(raw, dict) else {}
        return {"quant_method": "modelopt", "quant_algo": inner.get("quant_algo"),
                "ignore": inner.get("exclude_modules") or [],
                "kv_cache_quant_algo": inner.get("kv_cache_quant_algo")}
    return None


def read_scheme(qcfg: dict[str, Any] | None, requested: str | None) -> Fp8Scheme | None:
    """The scheme to serve with: the checkpoint's (``qcfg``), or ``--quantization``
    (``requested``) on an unquantized checkpoint; None for neither."""
    if requested is not None and requested not in QUANTIZATION_CHOICES:
        raise ModelLoadError(f"--quantization {requested!r} is not supported; supported: "
                             f"{', '.join(QUANTIZATION_CHOICES)}")
    if not qcfg:
        return AT_LOAD if requested == "fp8" else None
    scheme = _checkpoint_scheme(qcfg)
    if requested is not None:
        raise ModelLoadError(
            f"--quantization {requested} quantizes an unquantized checkpoint at load, but this "
            f"checkpoint is already quantized ({scheme.source}, served as {scheme.name}); "
            "drop --quantization")
    return scheme


def _checkpoint_scheme(qcfg: dict[str, Any]) -> Fp8Scheme:
    method = str(qcfg.get("quant_method", "")).lower()
    if method == "fp8":
        return _fp8_scheme(qcfg)
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(qcfg)
    if method.startswith("modelopt"):
        return _modelopt_scheme(qcfg)
    raise _refuse(f"quant_method {qcfg.get('quant_method')!r}")


def _fp8_scheme(qcfg: dict[str, Any]) -> Fp8Scheme:
    fmt = str(qcfg.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise _refuse(f"quant_method 'fp8' with fmt {fmt!r} (only e4m3)")
    act = str(qcfg.get("activation_scheme", "dynamic"))
    if act not in ("dynamic", "static"):
        raise _refuse(f"quant_method 'fp8' with activation_scheme {act!r}")
    ignore = tuple(qcfg.get("modules_to_not_convert") or qcfg.get("ignored_layers") or ())
    block = qcfg.get("weight_block_size")
    if block is None:
        return Fp8Scheme("fp8_per_tensor", "fp8_per_tensor", "fp8 (per-tensor)",
                         static_input=act == "static", ignore=ignore)
    if [int(b) for b in block] != list(BLOCK):
        raise _refuse(f"quant_method 'fp8' with weight_block_size {list(block)}")
    if act != "dynamic":
        raise _refuse("quant_method 'fp8' block-wise with activation_scheme 'static'")
    return Fp8Scheme("fp8_block", "fp8_block_128x128", "fp8 (block 128x128)",
                     scale_name="weight_scale_inv", block=BLOCK, ignore=ignore)


def _compressed_tensors_scheme(qcfg: dict[str, Any]) -> Fp8Scheme:
    fmt = qcfg.get("format")
    if fmt != "float-quantized":
        raise _refuse(f"compressed-tensors format {fmt!r}")
    groups = list((qcfg.get("config_groups") or {}).values())
    if not groups:
        raise _refuse("compressed-tensors without config_groups")
    schemes = {_ct_group_scheme(g) for g in groups}
    if len(schemes) != 1:
        raise _refuse("compressed-tensors with config groups of different schemes")
    kind, block, static = schemes.pop()
    ignore = tuple(qcfg.get("ignore") or ())
    source = f"compressed-tensors FP8 ({kind.removeprefix('fp8_').replace('_', '-')})"
    if kind == "fp8_block":
        return Fp8Scheme(kind, "fp8_block_128x128", source, block=block, ignore=ignore)
    if kind == "fp8_per_channel":
        return Fp8Scheme(kind, "fp8_per_channel_dynamic", source, ignore=ignore)
    return Fp8Scheme(kind, "fp8_per_tensor", source, static_input=static, ignore=ignore)


def _ct_group_scheme(group: dict[str, Any]) -> tuple[QuantKind, tuple[int, int] | None, bool]:
    """(kind, block, static input scale) of one compressed-tensors config group."""
    w = group.get("weights") or {}
    if w.get("num_bits") != 8 or w.get("type") != "float" or w.get("dynamic", False) \
            or not w.get("symmetric", True):
        raise _refuse(f"compressed-tensors weights {_brief(w)} (only static symmetric "
                      "8-bit float)")
    strategy = w.get("strategy")
    a = group.get("input_activations") or {}
    if a and (a.get("num_bits") != 8 or a.get("type") != "float"):
        raise _refuse(f"compressed-tensors input_activations {_brief(a)} (only 8-bit float)")
    static = bool(a) and not a.get("dynamic", False)
    if static and a.get("strategy") != "tensor":
        raise _refuse(f"compressed-tensors static input_activations strategy "
                      f"{a.get('strategy')!r} (only tensor)")
    if strategy == "channel":
        if static:
            raise _refuse("compressed-tensors channel weights with static input scales")
        return "fp8_per_channel", None, False
    if strategy == "tensor":
        return "fp8_per_tensor", None, static
    if strategy == "block":
        block = tuple(int(b) for b in (w.get("block_structure") or ()))
        if block != BLOCK or static:
            raise _refuse(f"compressed-tensors block weights {_brief(w)} (only block_structure "
                          "[128, 128] with dynamic activations)")
        return "fp8_block", BLOCK, False
    raise _refuse(f"compressed-tensors weight strategy {strategy!r}")


def _modelopt_scheme(qcfg: dict[str, Any]) -> Fp8Scheme:
    inner = qcfg.get("quantization")
    src = inner if isinstance(inner, dict) else qcfg
    algo = str(src.get("quant_algo") or "").upper()
    if algo != "FP8":
        raise _refuse(f"modelopt quant_algo {src.get('quant_algo')!r} (only FP8)")
    ignore = tuple(src.get("exclude_modules") or qcfg.get("ignore") or ())
    return Fp8Scheme("fp8_per_tensor", "fp8_per_tensor", "modelopt FP8", static_input=True,
                     ignore=ignore)


def _brief(d: dict[str, Any]) -> str:
    keys = ("num_bits", "type", "strategy", "dynamic", "block_structure", "group_size")
    return "{" + ", ".join(f"{k}: {d.get(k)!r}" for k in keys if k in d) + "}"
