"""Compile the FlashInfer kernels the executor uses ahead of time, into a bundle.

FlashInfer JIT-compiles each attention module (one per dtype, head_dim and kernel family)
with ``nvcc`` the first time it is used: minutes per module on the GPU machine, paid again
on every fresh machine, out of a small device budget. It also loads a prebuilt module from
``flashinfer/data/aot/<name>/<name>.so`` without compiling when that file exists. This
script builds the modules on any machine that has ``nvcc`` (no GPU needed) and copies them
there, so the bundle carried to the GPU machine starts with its kernels ready::

    # a bundle for this machine's Python, used only to compile (matching tvm-ffi):
    python scripts/flashinfer_bundle.py --wheels W311 --out /tmp/fib311 --backends fa2 \\
        --python-tag cp311
    # compile with it; copy the modules into the bundle that goes to the GPU machine:
    PYTHONPATH=/tmp/fib311 python scripts/flashinfer_prebuild.py --into .fi_bundle \\
        --archive .fi_bundle.tar.gz

The modules are plain shared libraries against tvm-ffi's C ABI (``Py_LIMITED_API``), so a
module compiled under one Python loads under another with the same tvm-ffi version.

Which modules: for each dtype (bf16, fp16) and head_dim (64, 128), the CUDA-core decode
module (``BatchDecodeWithPagedKVCacheWrapper``) and the FA2 batch-prefill module with
equal K/V strides (prefill, extend, and tensor-core decode): what
``executor/attention/flashinfer_backend.py`` calls over our page-size-1 pools, whose K and
V buffers have equal strides.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import sys
import time
from pathlib import Path

DTYPES = ("bfloat16", "float16")
HEAD_DIMS = (64, 128)


def specs(dtypes: tuple[str, ...], head_dims: tuple[int, ...]) -> list[tuple[str, object]]:
    import torch
    from flashinfer.jit.attention import modules as m

    out: list[tuple[str, object]] = []
    for dt_name, hd in itertools.product(dtypes, head_dims):
        dt = getattr(torch, dt_name)
        args = (dt, dt, dt, torch.int32, hd, hd, 0, False, False)
        out.append(("decode", m.gen_batch_decode_module(*args)))
        out.append(("fa2", m._gen_batch_prefill_primary_module("fa2", *args, False)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--into", type=Path, required=True,
                        help="bundle folder whose flashinfer/data/aot receives the modules")
    parser.add_argument("--archive", type=Path, help="rewrite this .tar.gz of the bundle")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--head-dims", default=",".join(map(str, HEAD_DIMS)))
    args = parser.parse_args(argv)
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0")
    os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")
    aot = args.into / "flashinfer" / "data" / "aot"
    if not (args.into / "flashinfer").is_dir():
        print(f"{args.into} holds no flashinfer package", file=sys.stderr)
        return 2
    todo = specs(tuple(args.dtypes.split(",")), tuple(int(h) for h in args.head_dims.split(",")))
    for kind, spec in todo:
        name = spec.name  # type: ignore[attr-defined]
        target = aot / name / f"{name}.so"
        if target.exists():
            print(f"have  {kind:6s} {name}")
            continue
        t0 = time.perf_counter()
        spec.build()  # type: ignore[attr-defined]
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(spec.jit_library_path, target)  # type: ignore[attr-defined]
        print(f"built {kind:6s} {name} in {time.perf_counter() - t0:.0f} s "
              f"({target.stat().st_size / 2**20:.1f} MiB)", flush=True)
    if args.archive:
        sys.path.insert(0, str(Path(__file__).parent))
        from flashinfer_bundle import write_archive

        print(f"archive: {args.archive} {write_archive(args.into, args.archive) / 2**20:.2f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
