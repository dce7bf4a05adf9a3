"""Build a trimmed, offline FlashInfer bundle for the sm90 attention wrappers.

The GPU machines have no package index and take at most 64 MiB of carried files, while the
``flashinfer-python`` 0.7.2.post1 wheel is 62 MB packed and 420 MB unpacked. This script
unpacks only what ``import flashinfer`` and the JIT builds of three wrappers need:

* ``BatchPrefillWithPagedKVCacheWrapper`` and ``BatchPrefillWithRaggedKVCacheWrapper``
  (FA2 and/or FA3 kernels),
* ``BatchDecodeWithPagedKVCacheWrapper`` (CUDA-core decode kernel; FA2 with
  ``use_tensor_cores=True``), including ``use_cuda_graph=True``.

It reads the two wheels (``flashinfer-python`` and ``apache-tvm-ffi`` for the target Python)
from ``--wheels`` and never touches the network::

    python scripts/flashinfer_bundle.py --wheels /tmp/fi/wheels --out .fi_bundle
    python scripts/flashinfer_bundle.py --wheels DIR --out .fi_bundle --backends fa2 \\
        --archive .fi_bundle.tar.gz

Put the output folder on ``PYTHONPATH`` on the GPU machine. docs/flashinfer.md gives the
download commands, the environment variables and what was and was not verified.

How the keep-list is derived (each rule below is applied to the wheel's own contents, so
nothing here is a hand-copied file list that could go stale silently):

* Python: the closure of module-level imports of ``flashinfer`` (imports inside functions
  are lazy and not followed; imports inside ``try``/``if`` blocks are followed, except
  branches gated on CuTe-DSL availability, since ``nvidia-cutlass-dsl`` is not shipped),
  plus all of ``flashinfer/jit`` (the kernel generators), the top-level modules and the
  Triton helpers used by ``get_batch_indices_positions``.
* JIT sources: the ``data/csrc`` templates and sources that
  ``flashinfer/jit/attention/modules.py`` copies for the batch decode, FA2 batch prefill
  and FA3 (sm90) batch prefill modules.
* Headers: the ``#include`` closure of those sources over the include path that
  ``flashinfer/jit/cpp_ext.py`` hands to nvcc. The scan ignores ``#if`` conditions, so it
  is a superset of what nvcc opens; headers it cannot find (CUDA toolkit, libc++) are
  expected on the GPU machine.
"""

from __future__ import annotations

import argparse
import ast
import json
import posixpath
import re
import shutil
import sys
import tarfile
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

FLASHINFER_VERSION = "0.7.2.post1"
MANIFEST_NAME = "FLASHINFER_BUNDLE.json"
MIB = 1024 * 1024

# Include path, in the order flashinfer/jit/cpp_ext.py:build_common_cflags passes it to nvcc:
# the vendored CCCL first (-I, so it overrides the toolkit's copy), then the -isystem dirs.
# Python's own include dir and $CUDA_HOME/include come from the GPU machine.
INCLUDE_DIRS: tuple[str, ...] = (
    "flashinfer/data/cccl/cub",
    "flashinfer/data/cccl/libcudacxx/include",
    "flashinfer/data/cccl/thrust",
    "tvm_ffi/include",  # tvm_ffi.libinfo.find_include_path() and find_dlpack_include_path()
    "flashinfer/data/include",
    "flashinfer/data/csrc",
    "flashinfer/data/cutlass/include",
    "flashinfer/data/cutlass/tools/util/include",
    "flashinfer/data/spdlog/include",
)

# CCCL headers that the CUDA 13.0 toolkit's own headers include (cuda_fp16.h, cuda_bf16.h,
# cuda_fp8.hpp, cooperative_groups): because the vendored CCCL comes first on the include
# path, these resolve into the bundle, so their closure must be kept too.
TOOLKIT_CCCL_ENTRY_HEADERS: tuple[str, ...] = (
    "nv/target",
    "cuda/atomic",
    "cuda/std/type_traits",
    "cuda/std/functional",
)

CSRC = "flashinfer/data/csrc/"

# data/csrc files that flashinfer/jit/attention/modules.py reads (jinja templates) or copies
# into the generated source folder, per kernel family.
CSRC_SOURCES: dict[str, tuple[str, ...]] = {
    # gen_customize_batch_decode_module: BatchDecodeWithPagedKVCacheWrapper
    # (use_tensor_cores=False), the CUDA-core decode kernel.
    "decode": (
        "batch_decode_customize_config.jinja",
        "batch_decode_kernel_inst.jinja",
        "batch_decode.cu",
        "batch_decode_jit_binding.cu",
    ),
    # gen_customize_batch_prefill_module(backend="fa2"), full and paged-only surfaces: the
    # prefill wrappers with backend="fa2" and tensor-core decode.
    "fa2": (
        "batch_prefill_customize_config.jinja",
        "batch_prefill_paged_kernel_inst.jinja",
        "batch_prefill_ragged_kernel_inst.jinja",
        "batch_prefill.cu",
        "batch_prefill_jit_binding.cu",
        "batch_prefill_paged.cu",
        "batch_prefill_paged_jit_binding.cu",
        "batch_prefill_paged.cuh",
    ),
    # gen_customize_batch_prefill_module(backend="fa3"), 16-bit q/kv only (the fp8 variants
    # batch_prefill_fp8_*sm90* are not shipped): what backend="auto" picks on sm90.
    "fa3": (
        "batch_prefill_sm90_customize_config.jinja",
        "batch_prefill_paged_sm90_kernel_inst.jinja",
        "batch_prefill_ragged_sm90_kernel_inst.jinja",
        "batch_prefill_sm90.cu",
        "batch_prefill_sm90_jit_binding.cu",
    ),
}

# Headers that reach the kernels through Python strings (variant_decl in
# flashinfer/jit/attention/modules.py) rather than through an #include in a source file.
VARIANT_HEADERS: dict[str, tuple[str, ...]] = {
    "decode": ("flashinfer/attention/variants.cuh",),
    "fa2": ("flashinfer/attention/variants.cuh",),
    "fa3": ("flashinfer/attention/hopper/variants.cuh",),
}

# Data files read by Python outside the include graph.
EXTRA_DATA_FILES: tuple[str, ...] = (
    # compilation_context.cutlass_supports_sm107() reads it while building any nvcc command
    # line (it degrades to False when the file is missing, so this is belt and braces).
    "flashinfer/data/cutlass/include/cutlass/arch/arch.h",
)

# Python packages kept whole, whether or not `import flashinfer` imports them eagerly.
ALWAYS_KEEP_PY_PREFIXES: tuple[str, ...] = (
    "flashinfer/jit/",  # the JIT spec generators and build driver (imported lazily too)
    "flashinfer/triton/",  # page.get_batch_indices_positions imports it lazily
    "flashinfer/cudnn/",  # decode/prefill plan() probe the cuDNN frontend version through it
)

INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*([<"])([^>"\n]+)[>"]', re.MULTILINE)
# cutlass/cutlass.h: #define CUDA_STD_HEADER(header) <cuda/std/header>
CUDA_STD_HEADER_RE = re.compile(
    r"^[ \t]*#[ \t]*include[ \t]+CUDA_STD_HEADER\([ \t]*([\w/.]+)[ \t]*\)", re.MULTILINE
)
CUTE_DSL_GATE_WORDS = ("cute_dsl", "cutedsl", "cutlass")


@dataclass
class Decision:
    keep: bool
    reason: str


@dataclass
class Report:
    kept: Counter[str] = field(default_factory=Counter)
    kept_bytes: Counter[str] = field(default_factory=Counter)
    dropped: Counter[str] = field(default_factory=Counter)
    dropped_bytes: Counter[str] = field(default_factory=Counter)

    def add(self, decision: Decision, size: int) -> None:
        if decision.keep:
            self.kept[decision.reason] += 1
            self.kept_bytes[decision.reason] += size
        else:
            self.dropped[decision.reason] += 1
            self.dropped_bytes[decision.reason] += size


class WheelSet:
    """The members of several wheels, addressed by their path inside the wheel."""

    def __init__(self, wheels: list[Path]) -> None:
        self._zips = [zipfile.ZipFile(w) for w in wheels]
        self.members: dict[str, tuple[zipfile.ZipFile, zipfile.ZipInfo]] = {}
        for zf in self._zips:
            for info in zf.infolist():
                if not info.is_dir():
                    self.members[info.filename] = (zf, info)

    def read(self, name: str) -> bytes:
        zf, info = self.members[name]
        return zf.read(info)

    def size(self, name: str) -> int:
        return self.members[name][1].file_size

    def close(self) -> None:
        for zf in self._zips:
            zf.close()


# ---------------------------------------------------------------------------------------
# Python: module-level import closure of `import flashinfer`
# ---------------------------------------------------------------------------------------


def _module_file(ws: WheelSet, module: str) -> tuple[str | None, bool]:
    base = module.replace(".", "/")
    if f"{base}/__init__.py" in ws.members:
        return f"{base}/__init__.py", True
    if f"{base}.py" in ws.members:
        return f"{base}.py", False
    return None, False


def _is_cute_dsl_gate(test: ast.expr) -> bool:
    """`if is_cute_dsl_available():` and the like: never true without nvidia-cutlass-dsl."""
    for node in ast.walk(test):
        name = getattr(node, "id", None) or getattr(node, "attr", None) or ""
        if any(word in name.lower() for word in CUTE_DSL_GATE_WORDS):
            return True
    return False


def _module_level_nodes(body: list[ast.stmt]) -> list[ast.stmt]:
    """Statements run at import time: skip function bodies, descend into blocks/classes."""
    out: list[ast.stmt] = []
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and _is_cute_dsl_gate(node.test):
            out.extend(_module_level_nodes(node.orelse))
            continue
        out.append(node)
        for attr in ("body", "orelse", "finalbody"):
            child = getattr(node, attr, None)
            if isinstance(child, list):
                out.extend(_module_level_nodes(child))
        for handler in getattr(node, "handlers", []):
            out.extend(_module_level_nodes(handler.body))
        for case in getattr(node, "cases", []):
            out.extend(_module_level_nodes(case.body))
    return out


def _internal_imports(ws: WheelSet, module: str) -> set[str]:
    path, is_pkg = _module_file(ws, module)
    assert path is not None
    tree = ast.parse(ws.read(path), filename=path)
    package = module if is_pkg else module.rpartition(".")[0]
    targets: set[str] = set()
    for node in _module_level_nodes(tree.body):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            targets.add(target)
            # `from pkg import name` imports pkg.name when that is a submodule
            targets.update(f"{target}.{alias.name}" for alias in node.names)
    found: set[str] = set()
    for target in targets:
        if target != "flashinfer" and not target.startswith("flashinfer."):
            continue
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            candidate = ".".join(parts[:i])
            if _module_file(ws, candidate)[0] is not None:
                found.add(candidate)
    return found


def python_keep_set(ws: WheelSet) -> set[str]:
    seen: set[str] = set()
    todo = ["flashinfer"]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo.extend(_internal_imports(ws, module) - seen)
    keep = {path for module in seen if (path := _module_file(ws, module)[0]) is not None}
    for name in ws.members:
        if not name.endswith(".py") or name.startswith("flashinfer/data/"):
            continue
        top_level = name.startswith("flashinfer/") and name.count("/") == 1
        if top_level or name.startswith(ALWAYS_KEEP_PY_PREFIXES):
            keep.add(name)
    return keep


# ---------------------------------------------------------------------------------------
# JIT sources and the #include closure
# ---------------------------------------------------------------------------------------


def _resolve_include(ws: WheelSet, name: str, current: str, quoted: bool) -> str | None:
    dirs = ([posixpath.dirname(current)] if quoted and current else []) + list(INCLUDE_DIRS)
    for directory in dirs:
        candidate = posixpath.normpath(posixpath.join(directory, name))
        if candidate in ws.members:
            return candidate
    return None


def header_keep_set(ws: WheelSet, backends: list[str]) -> tuple[set[str], int]:
    roots: list[str] = []
    todo: list[str] = []
    for family in ["decode", *backends]:
        roots.extend(CSRC + source for source in CSRC_SOURCES[family])
        for header in VARIANT_HEADERS[family]:
            resolved = _resolve_include(ws, header, "", quoted=False)
            if resolved is None:
                raise SystemExit(f"variant header {header} not found in the wheel")
            todo.append(resolved)
    for header in TOOLKIT_CCCL_ENTRY_HEADERS:
        resolved = _resolve_include(ws, header, "", quoted=False)
        if resolved is None:
            raise SystemExit(f"CCCL header {header} not found in the wheel")
        todo.append(resolved)
    missing = [root for root in roots if root not in ws.members]
    if missing:
        raise SystemExit(f"JIT sources missing from the wheel: {missing}")
    todo.extend(roots)
    seen: set[str] = set()
    unresolved: set[str] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        text = ws.read(path).decode("utf-8", errors="replace")
        found = [(quote == '"', name.strip()) for quote, name in INCLUDE_RE.findall(text)]
        found += [(False, f"cuda/std/{name}") for name in CUDA_STD_HEADER_RE.findall(text)]
        for quoted, name in found:
            resolved = _resolve_include(ws, name, path, quoted)
            if resolved is None:
                unresolved.add(name)  # toolkit / libstdc++ / generated *.inc: not ours
            elif resolved not in seen:
                todo.append(resolved)
    seen.update(p for p in EXTRA_DATA_FILES if p in ws.members)
    return seen, len(unresolved)


# ---------------------------------------------------------------------------------------
# Keep / drop decisions
# ---------------------------------------------------------------------------------------


def decide(name: str, py_keep: set[str], py_dirs: set[str], data_keep: set[str]) -> Decision:
    dist = name.split("/", 1)[0]
    if dist.endswith(".dist-info"):
        if dist.startswith("flashinfer_python") and name.endswith("/RECORD"):
            # 1.4 MB list of every file of the full wheel; pip is not used with the bundle
            return Decision(False, "flashinfer RECORD (describes the untrimmed wheel)")
        # METADATA/top_level for importlib.metadata; tvm_ffi.libinfo finds libtvm_ffi.so
        # through apache_tvm_ffi's RECORD
        return Decision(True, "dist-info metadata")
    if name.startswith("tvm_ffi/"):
        return _decide_tvm_ffi(name)
    if not name.startswith("flashinfer/"):
        # build_backend.py, build_utils.py (wheel build helpers), b12x/ (import alias for
        # the experimental b12x kernels, which are not shipped)
        return Decision(False, "wheel build helpers and the b12x alias package")
    if name.startswith("flashinfer/data/"):
        if name in data_keep:
            if name.startswith(CSRC) and not name.endswith((".h", ".cuh", ".inc")):
                return Decision(True, "JIT sources/templates (decode, FA2, FA3)")
            return Decision(True, "headers reachable from the JIT sources")
        if name.endswith(".py"):
            # cutlass/python (CUTLASS library generator), cccl/python, csrc code generators
            return Decision(False, "Python inside data/ (CUTLASS/CCCL tooling, csrc scripts)")
        if name.startswith(CSRC):
            return Decision(False, "csrc of other kernels (MoE, GEMM, MLA, sampling, ...)")
        return Decision(False, "headers not reachable from the kept JIT sources")
    if name.endswith(".py"):
        if name in py_keep:
            return Decision(True, "Python imported by `import flashinfer` / JIT generators")
        return Decision(False, "Python of lazily imported subsystems (see docs)")
    if name.endswith(("py.typed", ".pyi")):
        return Decision(True, "typing markers")
    if name.endswith(".json") and posixpath.dirname(name) in py_dirs:
        return Decision(True, "config files next to kept modules")
    # .cu/.cuh/.c/.h/.json/.md of experimental, MoE-EP, xqa, MLA, ... kernels
    return Decision(False, "kernel sources/configs of other features outside data/")


def _decide_tvm_ffi(name: str) -> Decision:
    base = posixpath.basename(name)
    if name.startswith("tvm_ffi/include/"):
        return Decision(True, "tvm_ffi + dlpack headers (nvcc -isystem)")
    if name.startswith("tvm_ffi/lib/") or re.fullmatch(r"core\..*\.so", base):
        # core.*.so has DT_NEEDED on both libtvm_ffi.so and libtvm_ffi_testing.so
        return Decision(True, "tvm_ffi runtime (core extension, lib/*.so)")
    if name.endswith((".py", ".pyi")) or base == "py.typed":
        return Decision(True, "tvm_ffi Python")
    # src/ and cython/ (sources of the prebuilt libraries), 3rdparty/ (libbacktrace
    # sources; dlpack.h is also in include/), share/ and CMakeLists.txt (CMake packaging)
    return Decision(False, "tvm_ffi build sources and CMake files")


# ---------------------------------------------------------------------------------------
# Wheels, output folder, archive
# ---------------------------------------------------------------------------------------


def find_wheels(wheels_dir: Path, python_tag: str, allow_other_version: bool) -> list[Path]:
    fi = sorted(wheels_dir.glob("flashinfer_python-*.whl"))
    tvm = sorted(wheels_dir.glob(f"apache_tvm_ffi-*-{python_tag}-*.whl"))
    if not fi:
        raise SystemExit(f"no flashinfer_python-*.whl in {wheels_dir} (see docs/flashinfer.md)")
    if not tvm:
        raise SystemExit(
            f"no apache_tvm_ffi-*-{python_tag}-*.whl in {wheels_dir}: download it for the "
            "GPU machine's Python (see docs/flashinfer.md)"
        )
    if len(fi) > 1 or len(tvm) > 1:
        raise SystemExit(f"several candidate wheels in {wheels_dir}: {fi + tvm}")
    version = fi[0].name.split("-")[1]
    if version != FLASHINFER_VERSION and not allow_other_version:
        raise SystemExit(
            f"{fi[0].name}: the keep rules were checked against {FLASHINFER_VERSION}; "
            "pass --allow-other-version to try anyway"
        )
    return [fi[0], tvm[0]]


def prepare_out(out: Path) -> None:
    if out.exists():
        if not out.is_dir():
            raise SystemExit(f"{out} exists and is not a folder")
        if any(out.iterdir()) and not (out / MANIFEST_NAME).exists():
            raise SystemExit(f"{out} is not empty and holds no {MANIFEST_NAME}; not removing it")
        shutil.rmtree(out)
    out.mkdir(parents=True)


def write_archive(out: Path, archive: Path) -> int:
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:gz", compresslevel=9) as tar:
        for path in sorted(out.rglob("*")):
            if path.is_file():
                tar.add(path, arcname=str(path.relative_to(out)), recursive=False)
    return archive.stat().st_size


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--wheels", type=Path, required=True, help="folder with the wheels")
    parser.add_argument("--out", type=Path, default=Path(".fi_bundle"), help="output folder")
    parser.add_argument(
        "--backends",
        default="fa2,fa3",
        help="prefill kernel families to ship: fa2, fa3 or fa2,fa3 (default). The decode "
        "kernel is always shipped. fa3 needs CUTLASS/CuTe headers (about 22 MiB) and is what "
        "backend='auto' picks on sm90",
    )
    parser.add_argument(
        "--python-tag", default="cp312", help="CPython tag of the GPU machine (default cp312)"
    )
    parser.add_argument("--archive", type=Path, help="also write this .tar.gz of the bundle")
    parser.add_argument("--allow-other-version", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends or any(b not in ("fa2", "fa3") for b in backends):
        raise SystemExit(f"--backends must list fa2 and/or fa3, got {args.backends!r}")
    wheels = find_wheels(args.wheels, args.python_tag, args.allow_other_version)
    ws = WheelSet(wheels)
    try:
        py_keep = python_keep_set(ws)
        data_keep, n_unresolved = header_keep_set(ws, backends)
        py_dirs = {posixpath.dirname(p) for p in py_keep}
        prepare_out(args.out)
        report = Report()
        total = 0
        for name in sorted(ws.members):
            decision = decide(name, py_keep, py_dirs, data_keep)
            size = ws.size(name)
            report.add(decision, size)
            if not decision.keep:
                continue
            target = args.out / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(ws.read(name))
            if name.endswith(".so"):
                target.chmod(0o755)
            total += size
    finally:
        ws.close()

    manifest = {
        "flashinfer_wheel": wheels[0].name,
        "tvm_ffi_wheel": wheels[1].name,
        "backends": ["decode", *backends],
        "total_bytes": total,
        "kept": {k: [n, report.kept_bytes[k]] for k, n in sorted(report.kept.items())},
        "dropped": {k: [n, report.dropped_bytes[k]] for k, n in sorted(report.dropped.items())},
    }
    (args.out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1) + "\n")

    print(f"wheels: {wheels[0].name}, {wheels[1].name}; kernels: decode, {', '.join(backends)}")
    print("kept:")
    for reason, count in report.kept.most_common():
        print(f"  {report.kept_bytes[reason] / MIB:8.2f} MiB {count:6d} files  {reason}")
    print("dropped:")
    for reason, count in report.dropped.most_common():
        print(f"  {report.dropped_bytes[reason] / MIB:8.2f} MiB {count:6d} files  {reason}")
    print(f"include names left to the toolkit/system: {n_unresolved}")
    print(f"bundle: {args.out} {total / MIB:.2f} MiB in {sum(report.kept.values())} files")
    if args.archive is not None:
        size = write_archive(args.out, args.archive)
        print(f"archive: {args.archive} {size / MIB:.2f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
