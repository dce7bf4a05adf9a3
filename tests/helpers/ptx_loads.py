"""Compile a decode kernel for sm_90 and print its global loads (run as a module).

Triton's compiler needs no GPU, but it needs the real ``triton.jit`` (not the
interpreter the CPU suite runs under), hence a process of its own:
``TRITON_INTERPRET`` unset, ``python -m tests.helpers.ptx_loads KERNEL`` prints one JSON
object: whether the PTX creates an L2 ``evict_first`` policy, and its global loads (the
opcodes with their qualifiers).
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def _kernel(name: str) -> tuple[Any, dict[str, str], dict[str, object], int]:
    if name == "skinny_row":
        from executor.kernels.skinny import kernel as skinny

        types = {n: "*bf16" for n in ("x_ptr", "res_ptr", "nw_ptr", "w_ptr", "out_ptr",
                                      "res_out_ptr")}
        types |= {"red_ptr": "*i64", "ctl_ptr": "*i64", "inv_k": "fp32", "eps": "fp32"}
        return (skinny._skinny_row_kernel, types,
                dict(INPUT_OP=skinny.PLAIN, BLOCK_N=2, BLOCK_K=2048,
                     REDUCE=skinny.NO_REDUCE, WORLD=1, USE_PDL=False), 8)
    if name == "moe_one_launch":
        from executor.kernels.moe import decode_persistent

        fn = decode_persistent._moe_decode_one_token_kernel
        types = {n: "*bf16" for n in fn.arg_names if n.endswith("_ptr")}
        types |= {"weights_ptr": "*fp32", "ids_ptr": "*i32", "count_ptr": "*i64",
                  "inv_k": "fp32", "eps": "fp32"}
        return (fn, types,
                dict(TOP_K=8, E_POW2=128, K_POW2=8, RENORMALIZE=True, ROUND_TO_ACT=True,
                     HAS_NORM=True, BLOCK_ROW=2048, BLOCK_N=16, BLOCK_K=256,
                     BLOCK_N_DOWN=8, BLOCK_K_DOWN=128, ROUTE_ROWS=4, USE_PDL=False), 4)
    raise SystemExit(f"unknown kernel {name!r}")


def main(name: str) -> None:
    fn, types, constexprs, num_warps = _kernel(name)
    names = list(fn.arg_names)
    signature = {n: ("constexpr" if n in constexprs else types.get(n, "i32")) for n in names}
    consts = {(names.index(n),): v for n, v in constexprs.items()}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps})
    ptx = str(compiled.asm["ptx"])
    print(json.dumps({"evict_first_policy": "createpolicy.fractional.L2::evict_first" in ptx,
                      "loads": re.findall(r"\bld\.global[\w.:]*", ptx)}))


if __name__ == "__main__":
    main(sys.argv[1])
