"""The decode kernels load their weights with the L2 evict-first policy
(``executor.kernels.cache_policy``) and their activations with the default one.

Compiled for sm_90 here (Triton's compiler needs no GPU): in the PTX, the weight loads
carry an ``L2::cache_hint`` under an ``evict_first`` policy, and the loads of the input
row (and the MoE scratch, through L2) carry none, so they stay in L2 while the weights
pass through.
"""

from __future__ import annotations

import re

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from executor.kernels.moe import decode_persistent
from executor.kernels.skinny import kernel as skinny

TARGET = GPUTarget("cuda", 90, 32)


def _ptx(fn: triton.JITFunction, types: dict[str, str], constexprs: dict[str, object],
         num_warps: int) -> str:
    names = list(fn.arg_names)
    signature = {n: ("constexpr" if n in constexprs else types.get(n, "i32")) for n in names}
    consts = {(names.index(n),): v for n, v in constexprs.items()}
    try:
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts),
                                  target=TARGET, options={"num_warps": num_warps})
    except Exception as err:  # no CUDA backend in this Triton build
        pytest.skip(f"cannot compile for sm_90 here: {err}")
    return str(compiled.asm["ptx"])


def _loads(ptx: str) -> tuple[list[str], list[str]]:
    """The global loads with an L2 cache hint and those without (atomics aside)."""
    loads = re.findall(r"\bld\.global[\w.:]*", ptx)
    hinted = [ld for ld in loads if "L2::cache_hint" in ld]
    plain = [ld for ld in loads if "L2::cache_hint" not in ld and ".acquire" not in ld]
    return hinted, plain


def test_skinny_row_kernel_streams_its_weight_evict_first() -> None:
    types = {n: "*bf16" for n in ("x_ptr", "res_ptr", "nw_ptr", "w_ptr", "out_ptr",
                                  "res_out_ptr")}
    types |= {"red_ptr": "*i64", "ctl_ptr": "*i64", "inv_k": "fp32", "eps": "fp32"}
    ptx = _ptx(skinny._skinny_row_kernel, types,
               dict(INPUT_OP=skinny.PLAIN, BLOCK_N=2, BLOCK_K=2048, REDUCE=skinny.NO_REDUCE,
                    WORLD=1, USE_PDL=False), num_warps=8)
    hinted, plain = _loads(ptx)
    assert "createpolicy.fractional.L2::evict_first" in ptx
    assert hinted and all("evict_first" in ld for ld in hinted)
    assert plain, "the input row loads without the weights' policy"


def test_one_launch_moe_streams_its_experts_evict_first() -> None:
    types = {n: "*bf16" for n in decode_persistent._moe_decode_one_token_kernel.arg_names
             if n.endswith("_ptr")}
    types |= {"weights_ptr": "*fp32", "ids_ptr": "*i32", "count_ptr": "*i64",
              "inv_k": "fp32", "eps": "fp32"}
    ptx = _ptx(decode_persistent._moe_decode_one_token_kernel, types,
               dict(TOP_K=8, E_POW2=128, K_POW2=8, RENORMALIZE=True, ROUND_TO_ACT=True,
                    HAS_NORM=True, BLOCK_ROW=2048, BLOCK_N=16, BLOCK_K=256, BLOCK_N_DOWN=8,
                    BLOCK_K_DOWN=128, ROUTE_ROWS=4, USE_PDL=False), num_warps=4)
    hinted, plain = _loads(ptx)
    assert "createpolicy.fractional.L2::evict_first" in ptx
    assert hinted and all("evict_first" in ld for ld in hinted)
    # the logits, input row, norm weight and the activations down reads back (``.cg``)
    assert any(".cg" in ld for ld in plain) and len(plain) >= 3
