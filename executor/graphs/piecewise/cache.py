"""On-disk cache of compiled pieces, keyed by model config, our code, torch and compiler.

Layout under ``cache_dir`` (one directory per key, so keys never see each other)::

    <cache_dir>/<key>/inductor/       TORCHINDUCTOR_CACHE_DIR while we compile: Inductor's
                                      FX-graph and AOTAutograd caches, Triton kernels
    <cache_dir>/<key>/artifacts.bin   torch.compiler.save_cache_artifacts() bundle

A restart with the same key finds Inductor's on-disk caches in place, so every piece is a
cache hit and start-up skips code generation and C++/Triton compilation (Dynamo tracing
and the split still run: they are cheap). The bundle is the portable form of the same
artifacts (one file to copy between machines or bake into an image); it is hot-loaded
into the keyed Inductor directory before compiling, when present.

Only ``inductor`` caches anything: ``eager`` pieces are the traced graphs themselves.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

_REPO = Path(__file__).resolve().parents[3]
# Code that decides what is traced and how it is split and compiled.
_CODE_GLOBS = ("executor/model/*.py", "executor/kernels/*.py", "executor/graphs/piecewise/*.py",
               "executor/attention/base.py")
ARTIFACTS = "artifacts.bin"


def code_fingerprint() -> str:
    """Hash of the source files that shape the traced graph and its compilation."""
    h = hashlib.sha256()
    for pattern in _CODE_GLOBS:
        for path in sorted(_REPO.glob(pattern)):
            h.update(str(path.relative_to(_REPO)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def compile_key(model_key: str, compiler: str, device: torch.device) -> str:
    """The cache directory name: ``model_key`` (the caller's hash of the model config and
    dtype), our code, the torch/triton versions, the compiler and the device kind."""
    parts: dict[str, str] = {
        "model": model_key,
        "code": code_fingerprint(),
        "torch": torch.__version__,
        "compiler": compiler,
        "device": device.type,
    }
    if device.type == "cuda":
        parts["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
        try:
            import triton

            parts["triton"] = str(triton.__version__)
        except ImportError:  # pragma: no cover - CUDA builds ship Triton
            parts["triton"] = "none"
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
    return f"{compiler}-{digest[:20]}"


class CompileCache:
    """One key's cache directory; a no-op when ``root`` is None."""

    def __init__(self, root: Path | None, key: str) -> None:
        self.key = key
        self.dir = None if root is None else root / key

    @property
    def enabled(self) -> bool:
        return self.dir is not None

    @contextmanager
    def inductor_dir(self) -> Iterator[None]:
        """Point Inductor (and the Triton cache under it) at this key's directory.

        NOTE: Inductor reads ``TORCHINDUCTOR_CACHE_DIR`` from the environment each time
        it needs the cache, so this is the only knob; it is set just for the calls that
        may compile and restored after.
        """
        if self.dir is None:
            yield
            return
        path = self.dir / "inductor"
        path.mkdir(parents=True, exist_ok=True)
        old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
        try:
            yield
        finally:
            if old is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = old

    def load(self) -> bool:
        """Hot-load the artifact bundle into the keyed Inductor directory; True if one
        was found and accepted."""
        if self.dir is None or not (self.dir / ARTIFACTS).is_file():
            return False
        with self.inductor_dir():
            info = torch.compiler.load_cache_artifacts((self.dir / ARTIFACTS).read_bytes())
        return info is not None

    def save(self) -> bool:
        """Write the artifacts this process produced (atomically); False if none."""
        if self.dir is None:
            return False
        result = torch.compiler.save_cache_artifacts()
        if result is None:
            return False
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f"{ARTIFACTS}.{os.getpid()}.tmp"
        tmp.write_bytes(result[0])
        tmp.replace(self.dir / ARTIFACTS)
        return True
