"""``ModelSpec``: the architecture facts we need, read once from an HF ``config.json``.

One table says what each supported architecture adds to the Llama decoder, so the model
code branches on named features (``qkv_bias``, ``qk_norm``), never on architecture names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from executor.errors import ModelLoadError


@dataclass(frozen=True)
class ArchFeatures:
    qkv_bias: bool = False  # biases on q/k/v projections (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)


ARCHITECTURES: dict[str, ArchFeatures] = {
    "LlamaForCausalLM": ArchFeatures(),
    "MistralForCausalLM": ArchFeatures(),
    "Qwen2ForCausalLM": ArchFeatures(qkv_bias=True),
    "Qwen3ForCausalLM": ArchFeatures(qk_norm=True),
}

# Mixture-of-experts families (``executor/model/moe.py``): the Llama decoder with a sparse
# MoE block in place of the MLP (``MoeSpec``).
MOE_ARCHITECTURES: dict[str, ArchFeatures] = {
    "MixtralForCausalLM": ArchFeatures(),
    "Qwen3MoeForCausalLM": ArchFeatures(qk_norm=True),
}
# MoE architectures we recognize but cannot serve, with the feature that stops us.
UNSERVED_MOE: dict[str, str] = {
    "Qwen2MoeForCausalLM": "shared experts",
    "DeepseekV2ForCausalLM": "shared experts and multi-head latent attention",
    "DeepseekV3ForCausalLM": "shared experts and multi-head latent attention",
    "Qwen3NextForCausalLM": "shared experts and linear attention",
    "GptOssForCausalLM": "expert biases and attention sinks",
}

# RoPE variants whose frequencies do not depend on the sequence length at run time.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class MoeSpec:
    """The sparse MoE block: ``num_experts`` SwiGLU experts of width ``intermediate_size``
    (one rank's share under tensor parallelism), ``top_k`` chosen per token by a linear
    router's softmax; ``renormalize``: the top-k probabilities are divided by their sum
    (Qwen3-MoE's ``norm_topk_prob``, always for Mixtral). ``weights_in_activation_dtype``:
    the routing weights are rounded to the activation dtype before they scale the experts'
    outputs (Qwen3-MoE), else kept in float32 (Mixtral). ``dense_layers`` keep a dense MLP
    of ``ModelSpec.intermediate_size`` (Qwen3-MoE's ``mlp_only_layers`` and
    ``decoder_sparse_step``)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    weights_in_activation_dtype: bool
    dense_layers: frozenset[int] = frozenset()

    def sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    features: ArchFeatures
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position: int
    tie_word_embeddings: bool
    sliding_window: int | None
    torch_dtype: str | None  # the checkpoint's dtype, informational
    moe: MoeSpec | None = None  # the mixture-of-experts block, None for dense models

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attn_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def num_params(self, active: bool = False) -> int:
        """Parameters of the whole model; ``active``: with only ``top_k`` experts per MoE
        layer (what one token reads)."""
        h, i, v, n = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_layers
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 2 * h
        mlp = 3 * h * i * n
        if self.moe is not None:
            sparse = sum(self.moe.sparse(layer) for layer in range(n))
            experts = self.moe.top_k if active else self.moe.num_experts
            mlp = 3 * h * i * (n - sparse) + sparse * (
                self.moe.num_experts * h + experts * 3 * h * self.moe.intermediate_size)
        return v * h * (1 if self.tie_word_embeddings else 2) + n * per_layer + mlp + h

    def check_servable(self, max_context: int) -> None:
        """Refuse configurations we would compute wrongly, saying why."""
        if self.sliding_window is not None and self.sliding_window < max_context:
            raise ModelLoadError(
                f"{self.architecture} config uses sliding-window attention (window "
                f"{self.sliding_window}) shorter than max_context {max_context}; sliding-window "
                "attention is not supported: serve with max_context <= the window"
            )


def _rope_from_config(cfg: Any) -> RopeSpec:
    # transformers >= 5 keeps theta and scaling together in ``rope_parameters``; older
    # configs have ``rope_theta`` and an optional ``rope_scaling`` dict.
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    scaling = getattr(cfg, "rope_scaling", None)
    if scaling:
        params = {**dict(scaling), **params}
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported RoPE type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return RopeSpec(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
    )


def _sliding_window(cfg: Any) -> int | None:
    """The window if any layer uses sliding-window attention, else None."""
    window = getattr(cfg, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        return int(window) if "sliding_attention" in layer_types else None
    if getattr(cfg, "use_sliding_window", True) is False:
        return None
    return int(window)


def spec_from_hf_config(cfg: Any) -> ModelSpec:
    """Build a ModelSpec from a transformers ``PretrainedConfig``."""
    archs = list(getattr(cfg, "architectures", None) or [])
    if not archs:
        raise ModelLoadError("config.json names no 'architectures'; expected one of "
                             f"{', '.join(ARCHITECTURES)}")
    arch = archs[0]
    supported = {**ARCHITECTURES, **MOE_ARCHITECTURES}
    if arch in UNSERVED_MOE:
        raise ModelLoadError(
            f"unsupported architecture {arch!r}: {UNSERVED_MOE[arch]} are not supported; "
            f"mixture-of-experts families supported: {', '.join(MOE_ARCHITECTURES)}")
    if arch not in supported:
        raise ModelLoadError(
            f"unsupported architecture {arch!r}; supported: {', '.join(supported)}"
        )
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"unsupported hidden_act {act!r}; supported: silu")
    features = supported[arch]
    if getattr(cfg, "attention_bias", False) and not features.qkv_bias:
        features = ArchFeatures(qkv_bias=True, qk_norm=features.qk_norm)
    if getattr(cfg, "mlp_bias", False):
        raise ModelLoadError("mlp_bias=True is not supported")
    num_heads = int(cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    dtype = getattr(cfg, "dtype", None)
    return ModelSpec(
        architecture=arch,
        features=features,
        vocab_size=int(cfg.vocab_size),
        hidden_size=int(cfg.hidden_size),
        intermediate_size=int(cfg.intermediate_size),
        num_layers=int(cfg.num_hidden_layers),
        num_heads=num_heads,
        num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.rms_norm_eps),
        rope=_rope_from_config(cfg),
        max_position=int(cfg.max_position_embeddings),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        sliding_window=_sliding_window(cfg),
        torch_dtype=str(dtype).replace("torch.", "") if dtype is not None else None,
        moe=_moe_from_config(cfg, arch) if arch in MOE_ARCHITECTURES else None,
    )


def _moe_from_config(cfg: Any, arch: str) -> MoeSpec:
    """The MoE block as each family's HF modeling file builds it (one-line refusals)."""
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    top_k = getattr(cfg, "num_experts_per_tok", None)
    if not experts or not top_k or not 1 <= int(top_k) <= int(experts):
        raise ModelLoadError(f"{arch} config has num_experts={experts}, num_experts_per_tok="
                             f"{top_k}; supported: 1 <= num_experts_per_tok <= num_experts")
    for feature in ("shared_expert_intermediate_size", "n_shared_experts"):
        if getattr(cfg, feature, None):
            raise ModelLoadError(f"{arch} config sets {feature}: shared experts are not "
                                 "supported; supported: routed experts only")
    layers = int(cfg.num_hidden_layers)
    if arch == "MixtralForCausalLM":  # every layer sparse, top-k always renormalized
        return MoeSpec(int(experts), int(top_k), int(cfg.intermediate_size), renormalize=True,
                       weights_in_activation_dtype=False)
    step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    only_dense = {int(i) for i in getattr(cfg, "mlp_only_layers", None) or ()}
    dense = frozenset(i for i in range(layers) if i in only_dense or (i + 1) % step != 0)
    return MoeSpec(int(experts), int(top_k), int(cfg.moe_intermediate_size),
                   renormalize=bool(getattr(cfg, "norm_topk_prob", False)),
                   weights_in_activation_dtype=True, dense_layers=dense)
