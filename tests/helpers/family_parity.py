"""Greedy parity of a served model family against HF transformers (float32, CPU).

``reference``: HF ``generate`` (greedy) for each prompt and the log-softmax of HF's
logits at every generated position. ``transcript``: the same prompts through a real
server, each prefilled in two chunks (the first without sampling, so the second reads the
first from the KV cache), then decoded on the device's last token, with the top
log-probabilities of every step. ``check``: tokens identical, and every step's top
log-probabilities within ``LOGPROB_ATOL`` of HF's (log-softmax of the last position's
logits: a logit error shows up in them one for one).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from service.gen.model_executor.v1 import executor_pb2 as pb

LOGPROB_ATOL = 1e-4
STEPS = 32
TOP = 5
#: Three prompts longer than the families' window (``tests.helpers.models.WINDOW``).
PROMPTS = ([(i * 37) % 250 + 3 for i in range(21)], [5, 6, 7, 200, 9, 10, 11, 12, 13, 14, 99],
           [(i * 11) % 240 + 9 for i in range(17)])
SCORED = pb.SamplingParams(temperature=0.0, logprobs=True, top_logprobs=TOP)


@dataclass
class Run:
    tokens: list[list[int]]  # per prompt, STEPS generated tokens
    # per prompt, per step: (token, logprob) of the top TOP, most likely first
    top: list[list[list[tuple[int, float]]]]


def reference(path: Path) -> Run:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                              attn_implementation="eager").eval()
    out = Run([], [])
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=STEPS,
                              min_new_tokens=STEPS, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
            full = gen[0].tolist()
            logprobs = torch.log_softmax(hf(gen[:, :-1]).logits[0].double(), dim=-1)
            rows = logprobs[len(prompt) - 1 :]  # (STEPS, vocab): the generated positions
            top = torch.topk(rows, TOP, dim=-1)
            out.tokens.append(full[len(prompt):])
            out.top.append([list(zip(i.tolist(), v.tolist(), strict=True))
                            for i, v in zip(top.indices, top.values, strict=True)])
    return out


def transcript(stub: object) -> Run:
    """The prompts through ``stub`` (an ExecutorStub); releases every sequence."""
    s = stub
    ids = [f"f{i}" for i in range(len(PROMPTS))]
    out = Run([[] for _ in PROMPTS], [[] for _ in PROMPTS])

    def take(outputs: object) -> None:
        for o in outputs:  # type: ignore[attr-defined]
            i = ids.index(o.seq_id)
            out.tokens[i].append(o.token_id)
            out.top[i].append([(e.token_id, e.logprob) for e in o.top_logprobs])

    split = [len(p) // 2 for p in PROMPTS]
    s.Prefill(pb.PrefillRequest(items=[  # type: ignore[attr-defined]
        pb.PrefillItem(seq_id=sid, token_ids=p[:k], sample=False)
        for sid, p, k in zip(ids, PROMPTS, split, strict=True)]), timeout=120)
    take(s.Prefill(pb.PrefillRequest(items=[  # type: ignore[attr-defined]
        pb.PrefillItem(seq_id=sid, token_ids=p[k:], sample=True, sampling=SCORED)
        for sid, p, k in zip(ids, PROMPTS, split, strict=True)]), timeout=120).outputs)
    for _ in range(STEPS - 1):
        take(s.Decode(pb.DecodeRequest(items=[  # type: ignore[attr-defined]
            pb.DecodeItem(seq_id=sid, use_last_sampled=True, sampling=SCORED)
            for sid in ids]), timeout=120).outputs)
    assert s.Release(pb.ReleaseRequest(seq_ids=ids), timeout=60  # type: ignore[attr-defined]
                     ).released == len(ids)
    return out


def check(got: Run, want: Run) -> None:
    for i in range(len(PROMPTS)):
        assert got.tokens[i] == want.tokens[i], f"prompt {i}"
        for step, (g, w) in enumerate(zip(got.top[i], want.top[i], strict=True)):
            assert [t for t, _ in g] == [t for t, _ in w], (i, step)
            for (_, a), (_, b) in zip(g, w, strict=True):
                assert abs(a - b) <= LOGPROB_ATOL, (i, step, a, b)


#: Server flags of the parity runs (float32 on CPU: the default there).
SERVE_ARGS = ["--kv-tokens", "512", "--max-context", "128", "--max-sequences", "4",
              "--drain-delay", "0"]
#: What Health reports of each ``tests.helpers.models`` kind (``model_features``).
FEATURES = {
    "mistral_window": {"sliding_window"},
    "qwen2_window": {"sliding_window", "qkv_bias"},
    "gemma2": {"sliding_window", "attn_logit_softcapping", "final_logit_softcapping",
               "gemma_norms"},
    "gemma3": {"sliding_window", "local_rope_base", "qk_norm", "gemma_norms"},
    "phi3": {"sliding_window", "partial_rotary", "fused_checkpoint"},
}


class References:
    """Each kind's tiny checkpoint and its HF ``reference``, made on first use and kept:
    the TP = 1 and TP = 2 parity tests of a kind share them (one per test session)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._made: dict[str, tuple[Path, Run]] = {}

    def get(self, kind: str) -> tuple[Path, Run]:
        if kind not in self._made:
            from tests.helpers.models import write_model

            path = write_model(self.root, kind, seed=3)
            self._made[kind] = (path, reference(path))
        return self._made[kind]


def serve_and_check(references: References, kind: str, tp: int = 1) -> None:
    """Serve ``kind``'s tiny checkpoint (``tp`` ranks, gloo), check Health's window and
    features and the greedy parity against HF."""
    from tests.helpers.models import WINDOW
    from tests.helpers.serving import ServeProcess

    path, want = references.get(kind)
    args = ["--model", str(path), *SERVE_ARGS]
    if tp > 1:
        args += ["--tensor-parallel-size", str(tp)]
    server = ServeProcess(args)
    try:
        server.wait_ready()
        model = server.stub.Health(pb.HealthRequest(), timeout=10).model
        assert model.tensor_parallel_size == tp
        assert model.sliding_window == WINDOW
        assert set(model.model_features) == FEATURES[kind]
        check(transcript(server.stub), want)
    finally:
        assert server.stop() == 0, "".join(server.lines)[-3000:]
