"""``ModelSpec``: the architecture facts we need, read once from an HF ``config.json``.

One table says what each supported architecture adds to the Llama decoder, so the model
code branches on named features (``qkv_bias``, ``qk_norm``, ``gemma_norms``), never on
architecture names. Per-layer facts (the sliding window, the RoPE base of sliding layers)
come from the config as Hugging Face defines them (``layer_types``, ``sliding_window``,
``use_sliding_window`` / ``max_window_layers``); what we cannot serve is refused here in
one line naming the architecture and the feature.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from executor.errors import ModelLoadError


@dataclass(frozen=True)
class ArchFeatures:
    qkv_bias: bool = False  # biases on q/k/v projections (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3, Gemma 3)
    # Gemma's decoder: (1 + weight) RMSNorms computed in float32, a norm after attention
    # and around the MLP (pre/post feed-forward), embeddings scaled by sqrt(hidden).
    gemma_norms: bool = False
    # The checkpoint stores q/k/v and gate/up fused (``qkv_proj``, ``gate_up_proj``: Phi-3).
    fused_checkpoint: bool = False


ARCHITECTURES: dict[str, ArchFeatures] = {
    "LlamaForCausalLM": ArchFeatures(),
    "MistralForCausalLM": ArchFeatures(),
    "Qwen2ForCausalLM": ArchFeatures(qkv_bias=True),
    "Qwen3ForCausalLM": ArchFeatures(qk_norm=True),
    "Phi3ForCausalLM": ArchFeatures(fused_checkpoint=True),
    "Gemma2ForCausalLM": ArchFeatures(gemma_norms=True),
    "Gemma3ForCausalLM": ArchFeatures(gemma_norms=True, qk_norm=True),
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
# MLP activations (gated: act(gate) * up).
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# Hugging Face ``layer_types`` entries we serve.
_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # The leading fraction of each head that is rotated (Phi-3's partial_rotary_factor).
    partial_rotary_factor: float = 1.0

    def rotary_dim(self, head_dim: int) -> int:
        return int(head_dim * self.partial_rotary_factor)


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
    torch_dtype: str | None  # the checkpoint's dtype, informational
    #: Per layer, the sliding window (keys at positions > p - window), 0 for full attention.
    layer_windows: tuple[int, ...] = ()
    #: The RoPE of sliding layers where it differs from ``rope`` (Gemma 3's local base).
    rope_local: RopeSpec | None = None
    activation: str = "silu"
    #: Attention scores scaled by this ** -0.5 (Gemma's ``query_pre_attn_scalar``); None:
    #: by head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    attn_softcap: float = 0.0  # attention logits capped at cap * tanh(x / cap); 0: none
    final_softcap: float = 0.0  # the LM head's logits, likewise
    moe: MoeSpec | None = None  # the mixture-of-experts block, None for dense models

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attn_scale(self) -> float:
        return 1.0 / math.sqrt(self.query_pre_attn_scalar or self.head_dim)

    @property
    def sliding_window(self) -> int | None:
        """The smallest window any layer uses, None when every layer attends fully."""
        return min((w for w in self.layer_windows if w), default=None)

    def layer_rope(self, layer_id: int) -> RopeSpec:
        """The RoPE of layer ``layer_id`` (sliding layers may have their own base)."""
        if self.rope_local is not None and self.layer_windows[layer_id]:
            return self.rope_local
        return self.rope

    @property
    def model_features(self) -> tuple[str, ...]:
        """Named features beyond a plain Llama decoder (reported by Health)."""
        named = (("sliding_window", self.sliding_window is not None),
                 ("attn_logit_softcapping", self.attn_softcap > 0),
                 ("final_logit_softcapping", self.final_softcap > 0),
                 ("local_rope_base", self.rope_local is not None),
                 ("partial_rotary", self.rope.partial_rotary_factor < 1),
                 ("qkv_bias", self.features.qkv_bias),
                 ("qk_norm", self.features.qk_norm),
                 ("gemma_norms", self.features.gemma_norms),
                 ("fused_checkpoint", self.features.fused_checkpoint))
        return tuple(name for name, on in named if on)

    def num_params(self, active: bool = False) -> int:
        """Parameters of the whole model; ``active``: with only ``top_k`` experts per MoE
        layer (what one token reads)."""
        h, i, v, n = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_layers
        norms = (4 * h if self.features.gemma_norms else 2 * h) + \
            (2 * self.head_dim if self.features.qk_norm else 0) + \
            (self.q_size + 2 * self.kv_size if self.features.qkv_bias else 0)
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + norms
        mlp = 3 * h * i * n
        if self.moe is not None:
            sparse = sum(self.moe.sparse(layer) for layer in range(n))
            experts = self.moe.top_k if active else self.moe.num_experts
            mlp = 3 * h * i * (n - sparse) + sparse * (
                self.moe.num_experts * h + experts * 3 * h * self.moe.intermediate_size)
        return v * h * (1 if self.tie_word_embeddings else 2) + n * per_layer + mlp + h

    def check_servable(self, max_context: int) -> None:
        """Refuse configurations we would compute wrongly, saying why (none left today:
        windows are served by every attention backend that starts with them)."""
        del max_context


def _rope_from_params(arch: str, params: dict[str, Any], theta_default: float
                      ) -> RopeSpec:
    theta = params.get("rope_theta", theta_default)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{arch}: unsupported RoPE type {rope_type!r}; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    return RopeSpec(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
        partial_rotary_factor=float(params.get("partial_rotary_factor", 1.0)),
    )


def _rope_from_config(arch: str, cfg: Any) -> tuple[RopeSpec, RopeSpec | None]:
    """The RoPE of full-attention layers, and that of sliding layers where the config
    gives them their own (``rope_parameters`` keyed by layer type: Gemma 3)."""
    # transformers >= 5 keeps theta and scaling together in ``rope_parameters``; older
    # configs have ``rope_theta`` and an optional ``rope_scaling`` dict.
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    theta = getattr(cfg, "rope_theta", 10000.0)
    if "full_attention" in params or "sliding_attention" in params:
        full = _rope_from_params(arch, dict(params.get("full_attention") or {}), theta)
        local_params = params.get("sliding_attention")
        local = _rope_from_params(arch, dict(local_params), theta) if local_params else None
        return full, (local if local != full else None)
    scaling = getattr(cfg, "rope_scaling", None)
    if scaling:
        params = {**dict(scaling), **params}
    if "partial_rotary_factor" not in params and hasattr(cfg, "partial_rotary_factor"):
        params["partial_rotary_factor"] = cfg.partial_rotary_factor
    return _rope_from_params(arch, params, theta), None


def _layer_windows(arch: str, cfg: Any, num_layers: int) -> tuple[int, ...]:
    """Per layer, the sliding window (0: full attention), as Hugging Face builds masks:
    ``layer_types`` where the config has them (Gemma 2/3, Qwen2/3 with
    ``use_sliding_window``); else every layer when ``sliding_window`` is set (Mistral,
    Phi-3), from ``max_window_layers`` on when the config has that switch."""
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        unknown = sorted(set(layer_types) - set(_LAYER_TYPES))
        if unknown:
            raise ModelLoadError(f"{arch}: unsupported layer types {', '.join(unknown)}; "
                                 f"supported: {', '.join(_LAYER_TYPES)}")
        if len(layer_types) != num_layers:
            raise ModelLoadError(f"{arch}: layer_types names {len(layer_types)} layers, "
                                 f"the config has {num_layers}")
        if not window:
            return (0,) * num_layers
        return tuple(int(window) if t == "sliding_attention" else 0 for t in layer_types)
    if not window or getattr(cfg, "use_sliding_window", True) is False:
        return (0,) * num_layers
    first = int(getattr(cfg, "max_window_layers", 0) or 0) \
        if hasattr(cfg, "use_sliding_window") else 0
    return tuple(int(window) if i >= first else 0 for i in range(num_layers))


def _activation(arch: str, cfg: Any) -> str:
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ModelLoadError(f"{arch}: unsupported hidden activation {act!r}; supported: "
                             f"{', '.join(SUPPORTED_ACTIVATIONS)}")
    return str(act)


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
    features = supported[arch]
    if getattr(cfg, "attention_bias", False) and not features.qkv_bias:
        if features.gemma_norms:  # Gemma's flag also puts a bias on o_proj
            raise ModelLoadError(f"{arch}: attention_bias=True is not supported")
        features = dataclasses.replace(features, qkv_bias=True)
    if getattr(cfg, "mlp_bias", False):
        raise ModelLoadError(f"{arch}: mlp_bias=True is not supported")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ModelLoadError(f"{arch}: use_bidirectional_attention=True is not supported "
                             "(causal decoders only)")
    num_layers = int(cfg.num_hidden_layers)
    num_heads = int(cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    dtype = getattr(cfg, "dtype", None)
    rope, rope_local = _rope_from_config(arch, cfg)
    if rope.partial_rotary_factor != 1.0 and (features.qk_norm or rope_local is not None
                                              or rope.rotary_dim(int(head_dim)) % 2):
        raise ModelLoadError(f"{arch}: partial_rotary_factor {rope.partial_rotary_factor} "
                             "is supported only without q/k norms and with an even "
                             "rotary width")
    activation = _activation(arch, cfg)
    if activation != "silu" and not features.gemma_norms:
        raise ModelLoadError(f"{arch}: unsupported hidden activation {activation!r}; "
                             "supported: silu")
    windows = _layer_windows(arch, cfg, num_layers)
    scalar = getattr(cfg, "query_pre_attn_scalar", None) if features.gemma_norms else None
    return ModelSpec(
        architecture=arch,
        features=features,
        vocab_size=int(cfg.vocab_size),
        hidden_size=int(cfg.hidden_size),
        intermediate_size=int(cfg.intermediate_size),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.rms_norm_eps),
        rope=rope,
        max_position=int(cfg.max_position_embeddings),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        torch_dtype=str(dtype).replace("torch.", "") if dtype is not None else None,
        layer_windows=windows if any(windows) else (),
        rope_local=rope_local if any(windows) else None,
        activation=activation,
        query_pre_attn_scalar=float(scalar) if scalar else None,
        attn_softcap=float(getattr(cfg, "attn_logit_softcapping", None) or 0.0),
        final_softcap=float(getattr(cfg, "final_logit_softcapping", None) or 0.0),
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
