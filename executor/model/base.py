"""The model seam: what the executor and the graph runners need of a model family.

A family registers its class for the Hugging Face architecture names it serves
(``register_model``); the loader builds whichever class the checkpoint's config names.
Variants within the Llama family (biases, q/k norm) are features in ``spec.py``, not
families.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

import torch

from executor.attention.base import AttentionBackend, AttentionMetadata
from executor.errors import ModelLoadError
from executor.model.spec import ModelSpec


class CausalModel(Protocol):
    """A decoder with an LM head, as the executor and graph runners drive it.

    ``__call__`` (the forward) returns final hidden states ``(T, hidden)`` in
    ``hidden_dtype``, storing each layer's new K/V through ``attn``; ``compute_logits``
    turns selected rows into logits ``(S, vocab)``, also in ``hidden_dtype`` (no float32
    cast: the sampler widens what it computes in float32), written into rows ``:S`` of
    ``out`` (a ``hidden_dtype`` buffer) and returned as that view when ``out`` is given.
    ``kernels`` names the element-wise implementation (part of what a compiled forward
    depends on).
    """

    spec: ModelSpec
    kernels: str

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 attn: AttentionBackend, meta: AttentionMetadata) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None
                       ) -> torch.Tensor: ...

    @property
    def hidden_dtype(self) -> torch.dtype: ...


class LoadableModel(CausalModel, Protocol):
    """What the loader needs besides: a module built on the meta device that it gives
    storage (``materialize``) and fills parameter by parameter."""

    def materialize(self, dtype: torch.dtype, device: torch.device) -> None: ...

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True
                         ) -> Iterator[tuple[str, torch.nn.Parameter]]: ...

    def eval(self) -> Any: ...


#: Builds a family's model: (spec, max positions) -> module, called on the meta device.
ModelFactory = Callable[[ModelSpec, int], LoadableModel]
_F = TypeVar("_F", bound=Callable[..., Any])

_FAMILIES: dict[str, ModelFactory] = {}


def register_model(*architectures: str) -> Callable[[_F], _F]:
    """Class decorator: the family serves these HF architecture names."""
    def register(factory: _F) -> _F:
        for name in architectures:
            if name in _FAMILIES:
                raise ValueError(f"architecture {name!r} registered twice")
            _FAMILIES[name] = factory
        return factory
    return register


def model_factory(architecture: str) -> ModelFactory:
    if architecture not in _FAMILIES:
        raise ModelLoadError(f"no model family serves {architecture!r}; supported: "
                             f"{', '.join(sorted(_FAMILIES))}")
    return _FAMILIES[architecture]
