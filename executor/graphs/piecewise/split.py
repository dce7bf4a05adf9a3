"""Split a Dynamo FX graph at every attention op, keeping the original node order.

The result is a top-level ``GraphModule`` whose body calls submodules in order:
``piece_0, attention_0, piece_1, attention_1, ..., piece_N`` (``N`` attention calls;
``N + 1`` pieces for a plain decoder, fewer if two attention ops were adjacent or an op
opened or closed the graph). Each attention submodule holds exactly one attention node
and runs eagerly; each piece holds the ops between two attention calls and is compiled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.split_module import split_module

from executor.graphs.piecewise.custom_op import is_attention

PieceKind = Literal["graph", "attention"]


@dataclass(frozen=True)
class Submodule:
    """One submodule of the split graph, in call order."""

    name: str  # attribute of the split GraphModule, e.g. "submod_3"
    kind: PieceKind
    index: int  # position among submodules of the same kind


@dataclass(frozen=True)
class SplitGraph:
    module: GraphModule
    submodules: tuple[Submodule, ...]

    @property
    def pieces(self) -> tuple[Submodule, ...]:
        return tuple(s for s in self.submodules if s.kind == "graph")

    @property
    def attention(self) -> tuple[Submodule, ...]:
        return tuple(s for s in self.submodules if s.kind == "attention")

    def submodule(self, name: str) -> torch.nn.Module:
        """The registered module ``name`` (attribute lookup may find the fast callable
        the backend installed in its place)."""
        module = self.module._modules[name]
        assert module is not None
        return module


def _partitions(gm: GraphModule) -> dict[Node, int]:
    """Partition id per computing node: attention ops get their own id, and the ids of
    the ops between them grow with node order, so partitions follow the original order."""
    part, out = 0, {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and is_attention(node.target):
            part += 1
            out[node] = part
            part += 1
        else:
            out[node] = part
    return out


def split_at_attention(gm: GraphModule) -> SplitGraph:
    """Split ``gm`` so every attention op is alone in its submodule (see module doc)."""
    parts = _partitions(gm)
    attention_parts = {p for n, p in parts.items() if is_attention(n.target)}
    split = split_module(gm, gm, lambda node: parts[node], keep_original_order=True)

    submodules: list[Submodule] = []
    counts = {"graph": 0, "attention": 0}
    for node in split.graph.nodes:
        if node.op != "call_module":
            continue
        # split_module names partition ``p`` "submod_{p}"
        part = int(str(node.target).rsplit("_", 1)[1])
        kind: PieceKind = "attention" if part in attention_parts else "graph"
        submodules.append(Submodule(str(node.target), kind, counts[kind]))
        counts[kind] += 1
    return SplitGraph(split, tuple(submodules))


def readable(gm: torch.nn.Module) -> str:
    """Readable Python of a (split) graph module, for the debug dump."""
    if isinstance(gm, GraphModule):
        return str(gm.print_readable(print_output=False))
    return repr(gm)
