"""Attention as the opaque custom op ``model_executor::attention`` (tc_piecewise).

Dynamo cannot trace attention (host-side per-batch metadata, variable-length loops), and
the piecewise split needs one recognisable node per attention call. So under
``tc_piecewise`` the model's attention backend is ``OpAttention``, whose ``forward`` calls
``torch.ops.model_executor.attention(q, k, v, layer_id)``: Dynamo records one opaque node
(shape from the fake impl) and ``split.py`` cuts the graph there.

The op's real impl needs what the node cannot carry: the inner attention backend and the
batch (metadata, real token count). It reads them from ``ATTENTION_BINDING``, which
``PiecewiseCompileBackend`` (its one owner) binds around every call of the compiled
forward; binding refuses nesting and clears in ``finally``. The batch itself lives in the
runner's ``BatchScope``, bound around capture (dummy batch) and replay (real batch). The
op stores K/V although its schema says "no mutation": see the NOTE at its registration.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from torch.fx import GraphModule, Node

from executor.attention.base import AttentionBackend, AttentionMetadata
from executor.forward_batch import ForwardBatch
from executor.graphs.backends import BatchScope

OP_NAMESPACE = "model_executor"
OP_NAME = "attention"


class AttentionBinding:
    """Which ``OpAttention`` the custom op runs right now.

    The op is process-global (a ``torch.ops`` entry), so what it reads must be reachable
    from it; this object is that link, with one owner (``PiecewiseCompileBackend``),
    bound only for the duration of one compiled-forward call.
    """

    def __init__(self) -> None:
        self._attn: OpAttention | None = None

    @contextmanager
    def bind(self, attn: OpAttention) -> Iterator[None]:
        if self._attn is not None:
            raise RuntimeError("nested tc_piecewise forward: one compiled forward at a time")
        self._attn = attn
        try:
            yield
        finally:
            self._attn = None

    def current(self) -> OpAttention:
        if self._attn is None:
            raise RuntimeError(f"{OP_NAMESPACE}::{OP_NAME} ran outside a tc_piecewise forward "
                               "(PiecewiseCompileBackend binds it)")
        return self._attn


ATTENTION_BINDING = AttentionBinding()


# NOTE: The op stores the layer's K/V into the KV pool, which is not an argument,
# so its schema says "no mutation". That is safe because nothing may reorder or drop it:
#
# * every attention node is a split point, so it is never inside a compiled piece: the
#   top-level split graph calls pieces and attention ops strictly in the original order,
#   and no compiler pass ever sees the op next to other ops;
# * its output is always consumed (``o_proj``), and the op is also registered with
#   ``torch.fx.node.has_side_effect``, so FX/Dynamo dead-code elimination keeps it even
#   if a model ever ignored the output.
@torch.library.custom_op(f"{OP_NAMESPACE}::{OP_NAME}", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int
                 ) -> torch.Tensor:
    """``(T, heads, head_dim)`` attention of the bound batch; stores K/V (see module doc)."""
    return ATTENTION_BINDING.current().run(q, k, v, layer_id)


@attention_op.register_fake
def _attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int
                    ) -> torch.Tensor:
    # Contiguous, like the real output (a row slice of ``OpAttention.out``): the piece
    # after the op is compiled against these strides.
    return q.new_empty(q.shape)


# Keep the op through any dead-code elimination (see module doc).
torch.fx.node.has_side_effect(torch.ops.model_executor.attention.default)
ATTENTION_OVERLOAD: Any = torch.ops.model_executor.attention.default


def is_attention(target: Any) -> bool:
    """True for an FX node target that is the attention op (overload or packet)."""
    return target is ATTENTION_OVERLOAD or target is torch.ops.model_executor.attention


def direct_call(gm: GraphModule) -> Callable[..., Any] | None:
    """An attention submodule of the split graph (one op call) as a plain function that
    calls the op's real impl, or None if ``gm`` is not of that form.

    After the split the op needs no opacity any more: it runs eagerly between pieces.
    Calling ``OpAttention.run`` directly skips the dispatcher, the custom-op wrappers and
    the FX module call: host time on every layer of every forward.
    """
    nodes = list(gm.graph.nodes)
    placeholders = {n: i for i, n in enumerate(x for x in nodes if x.op == "placeholder")}
    calls = [n for n in nodes if n.op == "call_function"]
    outputs = [n for n in nodes if n.op == "output"]
    if len(calls) != 1 or not is_attention(calls[0].target) or calls[0].kwargs:
        return None
    call = calls[0]
    if len(call.args) != 4 or not isinstance(call.args[3], int):
        return None
    q, k, v, layer_id = call.args
    if not all(isinstance(a, Node) and a in placeholders for a in (q, k, v)):
        return None
    iq, ik, iv = placeholders[q], placeholders[k], placeholders[v]
    result = outputs[0].args[0]
    if result is call:
        as_tuple = False
    elif isinstance(result, (tuple, list)) and len(result) == 1 and result[0] is call:
        as_tuple = True
    else:
        return None

    def attention(*args: Any) -> Any:
        out = ATTENTION_BINDING.current().run(args[iq], args[ik], args[iv], layer_id)
        return (out,) if as_tuple else out

    return attention


class OpAttention(AttentionBackend):
    """The attention the model calls under ``tc_piecewise``: one custom-op call per layer.

    ``forward`` ignores ``meta`` (the runner passes ``SCOPED``); the op reads the batch
    bound to ``scope``. Only the ``scope.num_tokens`` real tokens store K/V and attend;
    padded rows of the output are finite but otherwise unspecified.

    Output buffer. Every call writes into rows ``:T`` of one static ``out`` buffer
    ``(max_tokens, heads, head_dim)`` shared by all layers and shapes, so the piece after
    each attention reads the same address at capture and at every replay (no copy into
    the graph's static input), and capture holds no per-shape activation memory.
    NOTE: the returned tensor is valid only until the next attention call; the piece
    right after consumes it (``o_proj``) before the next layer's attention runs.
    Batches larger than ``max_tokens`` (eager fallback) get a fresh tensor instead.
    """

    name: ClassVar[str] = "tc_piecewise_op"

    def __init__(self, inner: AttentionBackend, scope: BatchScope, max_tokens: int) -> None:
        super().__init__(inner.shape, inner.pool, inner.table)
        self.inner, self.scope = inner, scope
        s = inner.shape
        # (max_tokens, heads, head_dim)
        self.out = torch.zeros(max_tokens, s.num_heads, s.head_dim, dtype=inner.pool.dtype,
                               device=inner.pool.k_buffer.device)

    def build_metadata(self, batch: ForwardBatch) -> AttentionMetadata:
        return self.inner.build_metadata(batch)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                meta: AttentionMetadata) -> torch.Tensor:
        del meta  # the op reads the batch bound to the scope
        out: torch.Tensor = torch.ops.model_executor.attention(q, k, v, layer_id)
        return out

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int
            ) -> torch.Tensor:
        """The op's real impl: attention of the bound batch's real tokens."""
        meta, n = self.scope.meta, self.scope.num_tokens
        if meta is None:
            raise RuntimeError("tc_piecewise attention without a bound batch (BatchScope.bind)")
        # The model rotated q and k (``fuses_rope`` is False here): the inner backend must
        # not again. tc_piecewise serves prefill only, which no backend fuses.
        assert not self.inner.fuses_rope(meta), "tc_piecewise attention with fused RoPE"
        t = q.shape[0]
        if n > t:
            raise RuntimeError(f"bound batch has {n} tokens but the forward has only {t}")
        if t <= self.out.shape[0] and q.dtype == self.out.dtype:
            out = self.out[:t]
        else:  # padded rows must be finite too
            out = (torch.empty if n == t else torch.zeros)(q.shape, dtype=q.dtype,
                                                           device=q.device)
        if n == t or self.inner.padded_rows_ok:  # no per-layer slicing (host time)
            self.inner.forward_into(q, k, v, out, layer_id, meta)
        else:
            self.inner.forward_into(q[:n], k[:n], v[:n], out[:n], layer_id, meta)
        # Padded rows ``n:`` keep what the buffer held (zeros or earlier attention
        # outputs): finite, never stored, never attended, and dropped with the padding.
        return out
