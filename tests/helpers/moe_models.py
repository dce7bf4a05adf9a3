"""Small random-weight mixture-of-experts checkpoints (Qwen3-MoE, Mixtral), for tests.

``write_moe_model`` draws our recipe (``random_weights``: the per-expert layout), loads it
into transformers and writes it back with ``save_pretrained``, so what is served is what
transformers itself writes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
}
# kind -> what it covers
MOE_KINDS = {
    "qwen3_moe": "8 experts, top 2, renormalized, layer 1 dense (mlp_only_layers)",
    "qwen3_moe_raw": "4 experts, top 2, not renormalized (norm_topk_prob false), all sparse",
    "mixtral": "8 experts, top 2 (always renormalized)",
}


def moe_config(kind: str) -> Any:
    import transformers as tf

    if kind == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**COMMON, head_dim=32, intermediate_size=96,
                                moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                norm_topk_prob=True, mlp_only_layers=[1], rope_theta=1e6)
        arch = "Qwen3MoeForCausalLM"
    elif kind == "qwen3_moe_raw":
        cfg = tf.Qwen3MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=48,
                                num_experts=4, num_experts_per_tok=2, norm_topk_prob=False)
        arch = "Qwen3MoeForCausalLM"
    elif kind == "mixtral":
        cfg = tf.MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=8,
                               num_experts_per_tok=2, sliding_window=None, rope_theta=1e6)
        arch = "MixtralForCausalLM"
    else:
        raise ValueError(kind)
    cfg.architectures = [arch]
    return cfg


def write_moe_model(root: Path, kind: str, seed: int = 0) -> Path:
    """``root/kind``: our random recipe, round-tripped through transformers'
    ``from_pretrained`` and ``save_pretrained`` (float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    from executor.weights.random_weights import write_random_model

    drawn = write_random_model(root / f"{kind}-drawn", moe_config(kind), seed=seed)
    model = AutoModelForCausalLM.from_pretrained(str(drawn), dtype=torch.float32)
    out = root / kind
    model.save_pretrained(str(out))
    return out


# -- greedy parity through the gRPC API (one process or tensor-parallel) -----------------
PROMPTS = [[(i * 37) % 250 + 3 for i in range(21)], [5, 17, 99, 4, 250, 31, 8],
           [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]
STEPS = 32
TOP = 5  # top log-probabilities compared at each step


def hf_greedy(path: Path, prompts: list[list[int]], steps: int
              ) -> list[tuple[list[int], Any]]:
    """Per prompt: HF ``generate``'s greedy tokens and the log-softmax of its logits at
    each step ``(steps, vocab)``, float32."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            res = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=steps, min_new_tokens=steps,
                                 eos_token_id=None, pad_token_id=0, output_logits=True,
                                 return_dict_in_generate=True)
        logprobs = torch.log_softmax(torch.cat(res.logits).float(), dim=-1)  # (steps, vocab)
        out.append((res.sequences[0, len(prompt):].tolist(), logprobs))
    return out


class References:
    """``write_moe_model(kind, seed)`` and its ``hf_greedy`` over ``PROMPTS``, made on
    first use and kept: the TP = 1 and TP = 2 serving tests share them (one per session)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._made: dict[tuple[str, int], tuple[Path, list[tuple[list[int], Any]]]] = {}

    def get(self, kind: str, seed: int) -> tuple[Path, list[tuple[list[int], Any]]]:
        if (kind, seed) not in self._made:
            path = write_moe_model(self.root / f"seed{seed}", kind, seed=seed)
            self._made[kind, seed] = (path, hf_greedy(path, PROMPTS, STEPS))
        return self._made[kind, seed]


def served_greedy(stub: Any, prompts: list[list[int]], steps: int, tag: str
                  ) -> list[list[tuple[int, float, list[tuple[int, float]]]]]:
    """Greedy ``steps`` tokens per prompt through Prefill (each prompt in two chunks, the
    first without sampling) and batched Decode calls: per prompt, each step's
    ``(token, logprob, top log-probabilities)``."""
    from service.gen.model_executor.v1 import executor_pb2 as pb

    sampling = pb.SamplingParams(temperature=0.0, logprobs=True, top_logprobs=TOP)
    seqs = [f"{tag}{i}" for i in range(len(prompts))]
    cut = [len(p) // 2 for p in prompts]
    stub.Prefill(pb.PrefillRequest(items=[
        pb.PrefillItem(seq_id=s, token_ids=p[:c], sample=False)
        for s, p, c in zip(seqs, prompts, cut, strict=True)]), timeout=60)
    response = stub.Prefill(pb.PrefillRequest(items=[
        pb.PrefillItem(seq_id=s, token_ids=p[c:], sample=True, sampling=sampling)
        for s, p, c in zip(seqs, prompts, cut, strict=True)]), timeout=60)
    out: list[list[tuple[int, float, list[tuple[int, float]]]]] = [[] for _ in prompts]

    def record(outputs: Any) -> None:
        for i, o in enumerate(outputs):
            top = [(t.token_id, t.logprob) for t in o.top_logprobs]
            out[i].append((o.token_id, o.logprob, top))

    record(response.outputs)
    for _ in range(steps - 1):
        response = stub.Decode(pb.DecodeRequest(items=[
            pb.DecodeItem(seq_id=s, token_id=out[i][-1][0], sampling=sampling)
            for i, s in enumerate(seqs)]), timeout=60)
        record(response.outputs)
    stub.Release(pb.ReleaseRequest(seq_ids=seqs), timeout=60)
    return out


def assert_matches_hf(served: list[list[tuple[int, float, list[tuple[int, float]]]]],
                      reference: list[tuple[list[int], Any]], atol: float = 1e-4) -> None:
    """Tokens identical; each step's log-probabilities (the sampled one and the top ones)
    within ``atol`` of HF's log-softmax of its last-position logits."""
    for steps, (tokens, logprobs) in zip(served, reference, strict=True):
        assert [s[0] for s in steps] == tokens
        for j, (token, logprob, top) in enumerate(steps):
            assert abs(logprob - float(logprobs[j, token])) <= atol, (j, token)
            assert len(top) == TOP
            for t, lp in top:
                assert abs(lp - float(logprobs[j, t])) <= atol, (j, t)


def gpu_moe_model(root: Path, kind: str) -> Path:
    """A bf16 MoE with the GPU tests' head layout (vocabulary 1024, hidden 512, 8 query and
    2 KV heads of 64): Qwen3-MoE (16 experts, top 4, layer 1 dense) or Mixtral (8 experts,
    top 2)."""
    import torch
    import transformers as tf

    from executor.weights.random_weights import write_random_model

    common = dict(vocab_size=1024, hidden_size=512, num_hidden_layers=3,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                  max_position_embeddings=4096, rms_norm_eps=1e-5)
    if kind == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**common, intermediate_size=1024, moe_intermediate_size=256,
                                num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
                                mlp_only_layers=[1])
        cfg.architectures = ["Qwen3MoeForCausalLM"]
    else:
        cfg = tf.MixtralConfig(**common, intermediate_size=512, num_local_experts=8,
                               num_experts_per_tok=2, sliding_window=None)
        cfg.architectures = ["MixtralForCausalLM"]
    return write_random_model(root / f"gpu-{kind}", cfg, seed=11, dtype=torch.bfloat16)
