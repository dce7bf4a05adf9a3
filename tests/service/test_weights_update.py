"""UpdateWeights from a directory, as a Session step, and Sleep/WakeUp, over a real server.

Serve random weights W1, update from a directory holding W2: greedy tokens equal HF
transformers on W2 (float32) and every StepInfo names the new version; a source with one
tensor of another shape, one missing or one unknown is refused naming it, and W1 keeps
serving the same tokens; the update as a Session step applies exactly between two decode
steps; Sleep refuses steps until WakeUp, which restores the same tokens; Sleep(kv_cache)
with live sequences is refused unless told to drop them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from executor.config import CacheConfig, ExecutorConfig, ModelConfig
from executor.weights.random_weights import write_random_model
from executor.weights.tiny import tiny_config
from service.gen.model_executor.v1 import executor_pb2 as pb
from service.health import READINESS_SERVICE
from tests.service.harness import ServerHarness

PROMPTS = [[5, 17, 99, 4, 250, 311, 8], [(i * 37) % 500 + 3 for i in range(20)], [42, 7]]
STEPS = 16


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("weights")
    w1 = write_random_model(root / "w1", tiny_config(), seed=11)
    w2 = write_random_model(root / "w2", tiny_config(), seed=22)
    sd = load_file(str(w2 / "model.safetensors"))
    bad = {}
    for kind in ("shape", "missing", "unknown", "dtype"):
        d = root / kind
        d.mkdir()
        (d / "config.json").write_text((w2 / "config.json").read_text())
        broken = dict(sd)
        if kind == "shape":
            broken["model.layers.1.mlp.up_proj.weight"] = torch.zeros(8, 8)
        elif kind == "missing":
            del broken["model.layers.2.self_attn.v_proj.weight"]
        elif kind == "unknown":
            broken["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(4)
        else:
            broken["model.norm.weight"] = broken["model.norm.weight"].half()
        save_file(broken, str(d / "model.safetensors"))
        bad[kind] = d
    return {"w1": w1, "w2": w2, **bad}


@pytest.fixture(scope="module")
def server(dirs: dict[str, Path]) -> Iterator[ServerHarness]:
    config = ExecutorConfig(model=ModelConfig(source=str(dirs["w1"])), device="cpu",
                            cache=CacheConfig(kv_tokens=1024, max_sequences=8,
                                              max_context=256),
                            max_prefill_tokens=1024, max_decode_batch=8)
    harness = ServerHarness(config)
    try:
        harness.wait_ready()
        yield harness
    finally:
        harness.close()


def hf_greedy(path: Path, prompt: list[int], steps: int) -> list[int]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    config = GenerationConfig(max_new_tokens=steps, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return list(out[0, len(prompt):].tolist())


def generate(server: ServerHarness, tag: str, versions: set[str] | None = None
             ) -> list[list[int]]:
    """Greedy tokens of every prompt (one batch), released after; the StepInfo versions
    seen are added to ``versions``."""
    stub = server.stub
    ids = [f"{tag}-{i}" for i in range(len(PROMPTS))]
    out = stub.Prefill(pb.PrefillRequest(items=[
        pb.PrefillItem(seq_id=s, token_ids=p, sample=True) for s, p in zip(ids, PROMPTS,
                                                                           strict=True)]),
        timeout=30)
    tokens = [[o.token_id] for o in out.outputs]
    seen = {out.step.weight_version}
    for _ in range(STEPS - 1):
        step = stub.Decode(pb.DecodeRequest(items=[
            pb.DecodeItem(seq_id=s, use_last_sampled=True) for s in ids]), timeout=30)
        seen.add(step.step.weight_version)
        for row, o in zip(tokens, step.outputs, strict=True):
            row.append(o.token_id)
    stub.Release(pb.ReleaseRequest(seq_ids=ids), timeout=30)
    if versions is not None:
        versions |= seen
    return tokens


def update(server: ServerHarness, version: str, path: Path, request_id: str = ""
           ) -> pb.UpdateWeightsResponse:
    return server.stub.UpdateWeights(pb.UpdateWeightsRequest(
        weight_version=version, path=str(path), request_id=request_id), timeout=60)


def model_info(server: ServerHarness) -> pb.ModelInfo:
    return server.stub.Health(pb.HealthRequest(), timeout=5).model


def test_update_from_disk_serves_the_new_weights(server: ServerHarness,
                                                 dirs: dict[str, Path]) -> None:
    versions: set[str] = set()
    before = generate(server, "w1", versions)
    assert versions == {"initial"} and model_info(server).weight_version == "initial"
    for kind, named in (("shape", "model.layers.1.mlp.up_proj.weight"),
                        ("missing", "model.layers.2.self_attn.v_proj.weight"),
                        ("unknown", "model.layers.0.mlp.extra_proj.weight"),
                        ("dtype", "model.norm.weight")):
        with pytest.raises(grpc.RpcError) as err:
            update(server, f"bad-{kind}", dirs[kind])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, kind
        assert named in str(err.value.details()), (kind, err.value.details())
    with pytest.raises(grpc.RpcError) as err:  # a path that is not a checkpoint
        update(server, "nowhere", dirs["w1"] / "absent")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:  # a version is required
        update(server, "", dirs["w2"])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "weight_version" in str(err.value.details())
    # the refusals changed nothing: W1's tokens, W1's version
    versions = set()
    assert generate(server, "still-w1", versions) == before and versions == {"initial"}

    done = update(server, "step-2", dirs["w2"], request_id="update-1")
    assert done.weight_version == "step-2" and done.tensors_updated == 39
    assert done.bytes_updated == (dirs["w2"] / "model.safetensors").stat().st_size - \
        _header_bytes(dirs["w2"] / "model.safetensors")
    assert update(server, "step-2", dirs["w2"], request_id="update-1") == done  # a retry
    assert model_info(server).weight_version == "step-2"
    versions = set()
    after = generate(server, "w2", versions)
    assert versions == {"step-2"}
    assert after == [hf_greedy(dirs["w2"], p, STEPS) for p in PROMPTS]
    assert after != before
    update(server, "initial-again", dirs["w1"])
    assert generate(server, "back", None) == before


def _header_bytes(file: Path) -> int:
    with file.open("rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_update_as_a_session_step_applies_between_two_decodes(
        server: ServerHarness, dirs: dict[str, Path]) -> None:
    update(server, "w1", dirs["w1"])
    # reference: two decodes on W1, the rest on W2, one sequence, step by step
    stub = server.stub
    prompt = PROMPTS[0]

    def requests() -> Iterator[pb.SessionRequest]:
        yield pb.SessionRequest(step=1, prefill=pb.PrefillRequest(items=[
            pb.PrefillItem(seq_id="s", token_ids=prompt, sample=True)]))
        for step in (2, 3):
            yield pb.SessionRequest(step=step, decode=pb.DecodeRequest(items=[
                pb.DecodeItem(seq_id="s", use_last_sampled=True)]))
        yield pb.SessionRequest(step=4, update_weights=pb.UpdateWeightsRequest(
            weight_version="w2", path=str(dirs["w2"])))
        for step in (5, 6, 7):
            yield pb.SessionRequest(step=step, decode=pb.DecodeRequest(items=[
                pb.DecodeItem(seq_id="s", use_last_sampled=True)]))
        yield pb.SessionRequest(step=8, release=pb.ReleaseRequest(seq_ids=["s"]))

    answers = list(stub.Session(requests(), timeout=60))
    kinds = [a.WhichOneof("result") for a in answers]
    assert kinds == ["prefill", "decode", "decode", "update_weights", "decode", "decode",
                     "decode", "release"], answers
    steps = [getattr(a, k) for a, k in zip(answers, kinds, strict=True)]
    assert [s.step.weight_version for s in steps[:3]] == ["w1"] * 3
    assert [s.step.weight_version for s in steps[4:7]] == ["w2"] * 3
    tokens = [s.outputs[0].token_id for s in steps[:3] + steps[4:7]]
    # the same split by unary calls: W1 for the prefill and two decodes, then W2
    update(server, "w1-again", dirs["w1"])
    out = stub.Prefill(pb.PrefillRequest(items=[
        pb.PrefillItem(seq_id="u", token_ids=prompt, sample=True)]), timeout=30)
    expected = [out.outputs[0].token_id]
    for i in range(5):
        if i == 2:
            update(server, "w2-again", dirs["w2"])
        d = stub.Decode(pb.DecodeRequest(items=[
            pb.DecodeItem(seq_id="u", use_last_sampled=True)]), timeout=30)
        expected.append(d.outputs[0].token_id)
    stub.Release(pb.ReleaseRequest(seq_ids=["u"]), timeout=30)
    assert tokens == expected
    update(server, "w1", dirs["w1"])


def test_sleep_refuses_steps_and_wake_up_restores_the_tokens(server: ServerHarness,
                                                             dirs: dict[str, Path]) -> None:
    update(server, "w1", dirs["w1"])
    before = generate(server, "pre-sleep")
    stub = server.stub
    stub.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(seq_id="live", token_ids=[1, 2, 3])]),
                 timeout=30)
    with pytest.raises(grpc.RpcError) as err:  # a live sequence holds the KV cache
        stub.Sleep(pb.SleepRequest(tags=["kv_cache"]), timeout=30)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "live" in str(err.value.details()) and "drop_sequences" in str(err.value.details())
    with pytest.raises(grpc.RpcError) as err:
        stub.Sleep(pb.SleepRequest(tags=["optimizer"]), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert server.ready() == 1  # SERVING: still awake

    slept = stub.Sleep(pb.SleepRequest(tags=["weights", "kv_cache"], drop_sequences=True),
                       timeout=30)
    assert list(slept.dropped_seq_ids) == ["live"] and slept.freed_bytes > 0
    assert list(slept.sleeping) == ["weights", "kv_cache"]
    health = stub.Health(pb.HealthRequest(), timeout=5)
    assert health.state == pb.SERVER_STATE_SLEEPING
    assert list(health.model.sleeping) == ["weights", "kv_cache"]
    assert server.check(READINESS_SERVICE) == 2 and server.check("") == 1
    assert health.kv.active_sequences == 0
    metrics = server.scrape()  # asleep on purpose: the not-ready alert stays quiet
    assert metrics[("model_executor_sleeping", ())] == 1
    assert metrics[("model_executor_healthy", ())] == 0
    assert metrics[("model_executor_weight_updates_total", (("source", "disk"),))] >= 1
    # the memory really went: every parameter and pool storage is empty
    ex: Any = server.executor
    assert all(p.untyped_storage().nbytes() == 0 for p in ex.model.parameters())
    assert ex.pool.k_buffer.untyped_storage().nbytes() == 0
    with pytest.raises(grpc.RpcError) as err:
        stub.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(seq_id="x", token_ids=[1],
                                                             sample=True)]), timeout=30)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "asleep" in str(err.value.details())

    woke = stub.WakeUp(pb.WakeUpRequest(), timeout=60)
    assert list(woke.sleeping) == [] and not woke.weights_discarded
    assert stub.Health(pb.HealthRequest(), timeout=5).state == pb.SERVER_STATE_READY
    assert server.scrape()[("model_executor_sleeping", ())] == 0
    assert generate(server, "post-sleep") == before


def test_discarded_weights_wait_for_an_update(server: ServerHarness,
                                              dirs: dict[str, Path]) -> None:
    update(server, "w1", dirs["w1"])
    before = generate(server, "pre-discard")
    stub = server.stub
    stub.Sleep(pb.SleepRequest(tags=["weights"], discard_weights=True), timeout=30)
    woke = stub.WakeUp(pb.WakeUpRequest(), timeout=60)
    assert woke.weights_discarded  # memory back, values not: still not servable
    health = stub.Health(pb.HealthRequest(), timeout=5)
    assert health.state == pb.SERVER_STATE_SLEEPING and health.model.weights_discarded
    with pytest.raises(grpc.RpcError) as err:
        stub.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(seq_id="x", token_ids=[1],
                                                             sample=True)]), timeout=30)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # a refused update keeps it that way; a good one refills and serves again
    with pytest.raises(grpc.RpcError):
        update(server, "bad", dirs["missing"])
    assert stub.Health(pb.HealthRequest(), timeout=5).state == pb.SERVER_STATE_SLEEPING
    update(server, "refilled", dirs["w1"])
    assert stub.Health(pb.HealthRequest(), timeout=5).state == pb.SERVER_STATE_READY
    assert generate(server, "post-discard") == before
    # asleep with discarded weights: an update refills them (and wakes them) directly
    stub.Sleep(pb.SleepRequest(tags=["weights"], discard_weights=True), timeout=30)
    update(server, "refilled-asleep", dirs["w1"])
    assert stub.Health(pb.HealthRequest(), timeout=5).state == pb.SERVER_STATE_READY
    assert generate(server, "post-refill") == before


def test_a_draining_server_refuses_updates(server: ServerHarness,
                                           dirs: dict[str, Path]) -> None:
    from service.health import State

    lifecycle = server.server.lifecycle
    lifecycle._state = State.DRAINING  # as during a graceful stop, without stopping
    try:
        for call in (lambda: update(server, "late", dirs["w2"]),
                     lambda: server.stub.Sleep(pb.SleepRequest(), timeout=30)):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "DRAINING" in str(err.value.details())
    finally:
        lifecycle._state = State.READY
    assert model_info(server).weight_version != "late"


def test_the_debug_client_updates_sleeps_and_wakes(server: ServerHarness, dirs: dict[str, Path],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from service.cli import main

    base = ["client", "--target", server.target]
    assert main([*base, "update-weights", "--path", str(dirs["w2"]),
                 "--weight-version", "from-cli"]) == 0
    assert json.loads(capsys.readouterr().out)["weight_version"] == "from-cli"
    assert main([*base, "sleep", "--tag", "weights"]) == 0
    assert json.loads(capsys.readouterr().out)["sleeping"] == ["weights"]
    assert main([*base, "wake-up"]) == 0
    assert json.loads(capsys.readouterr().out).get("sleeping", []) == []
    assert model_info(server).weight_version == "from-cli"
