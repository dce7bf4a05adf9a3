"""New weights into the served model, in place: check the whole source, then copy.

``WeightLayout`` is the served checkpoint as the loader maps it: each checkpoint tensor's
name, full (unsharded) shape and dtype, and where it lands (our parameter, its fused
shard). ``WeightLayout.check`` refuses a manifest (a directory's headers, or a trainer's
list) naming the first tensor that is unknown, of another shape or dtype, or missing,
before anything is written. ``copy_tensor`` then copies one checkpoint tensor's slice for
this rank into the EXISTING parameter (``sharding.copy_shard``, as at load), so every
address a captured CUDA graph holds stays valid.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
from safetensors import safe_open

from executor.errors import FieldViolation, InvalidRequest
from executor.model.spec import ModelSpec
from executor.weights import experts
from executor.weights.loader import (
    _IGNORED_RE,
    _expected_sources,
    _internal_name,
    _shard_rows,
    _weight_files,
)
from executor.weights.sharding import copy_shard, split_dim

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
    "float64": torch.float64,
}
# safetensors' header names
_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
              "F64": torch.float64}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype | None:
    return _DTYPE_NAMES.get(name.removeprefix("torch."))


@dataclass(frozen=True)
class TensorMeta:
    """One checkpoint tensor: its name, full shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class _Slot:
    param: str  # our parameter's name
    shard: int | None  # its fused shard (q, k, v / gate, up), or None
    shape: tuple[int, ...]  # the checkpoint tensor's full shape
    dtype: torch.dtype  # the served checkpoint's dtype of it


class WeightLayout:
    """The served model's checkpoint tensors: what an update must provide, exactly."""

    def __init__(self, model: torch.nn.Module, spec: ModelSpec, tp_size: int,
                 reference: dict[str, torch.dtype] | None = None) -> None:
        """``spec`` is this rank's (its heads); ``reference`` the served checkpoint's dtype
        of each tensor by internal ``name[shard]`` (None: the parameters' dtype, as for
        random weights)."""
        self.model, self.spec, self.tp_size = model, spec, tp_size
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self._slots: dict[tuple[str, int | None], _Slot] = {}
        for name, shard in _expected_sources(model, spec):  # type: ignore[arg-type]
            if experts.is_stacked(name):  # one expert's gate, up or down each
                assert shard is not None
                src = experts.ExpertSource(name, shard if name.endswith("down_proj")
                                           else shard // 2, 0)
                dtype = (reference or {}).get(_key(name, None), self.params[name].dtype)
                self._slots[(name, shard)] = _Slot(
                    name, shard, experts.full_shape(src, self.params[name], tp_size), dtype)
                continue
            target = self.target(name, shard)
            dtype = (reference or {}).get(_key(name, shard), target.dtype)
            self._slots[(name, shard)] = _Slot(name, shard, self._full(name, target), dtype)

    def target(self, name: str, shard: int | None) -> torch.Tensor:
        """This rank's tensor (a view of the parameter) a checkpoint tensor lands in."""
        target: torch.Tensor = self.params[name]
        if shard is not None:
            rows = _shard_rows(self.spec, name)
            target = target[rows[shard] : rows[shard + 1]]
        return target

    def _full(self, name: str, target: torch.Tensor) -> tuple[int, ...]:
        local = tuple(target.shape)
        dim = split_dim(name)
        if dim is None or self.tp_size == 1:
            return local
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return (self.spec.vocab_size, *local[1:])
        return tuple(d * self.tp_size if i == dim else d for i, d in enumerate(local))

    def resolve(self, hf_name: str) -> tuple[str, int | None] | None:
        """Our (parameter, shard) for a checkpoint name; None for one skipped on purpose
        (recomputed buffers, a tied head's copy); KeyError-free: unknown names give a key
        not in the layout."""
        if _IGNORED_RE.search(hf_name):
            return None
        name, shard = _internal_name(experts.canonical(hf_name))
        if self.spec.tie_word_embeddings and name == "lm_head.weight":
            return None
        return name, shard

    def check(self, manifest: Sequence[TensorMeta], where: str) -> None:
        """Refuse (INVALID_ARGUMENT, naming the first offending tensor) a manifest that
        is not exactly the served checkpoint: an unknown name, a repeated one, another
        shape or dtype, or a tensor missing."""
        seen: set[tuple[str, int | None]] = set()
        for i, meta in enumerate(manifest):
            keys, shape = self._entry(meta.name)
            if not keys:
                continue
            slots = [self._slots.get(key) for key in keys]
            field = f"{where}[{i}]" if where.endswith("tensors") else where
            slot = slots[0]
            if slot is None or None in slots:
                _refuse(field, f"unknown tensor {meta.name!r}: the served "
                        f"{self.spec.architecture} has no such weight")
            if seen.intersection(keys):
                _refuse(field, f"tensor {meta.name!r} is given twice")
            if meta.shape != (shape or slot.shape):
                _refuse(field, f"tensor {meta.name!r} has shape {list(meta.shape)}; the "
                        f"served model's is {list(shape or slot.shape)}")
            if meta.dtype != slot.dtype:
                _refuse(field, f"tensor {meta.name!r} is {dtype_name(meta.dtype)}; the "
                        f"served checkpoint's is {dtype_name(slot.dtype)}")
            seen.update(keys)
        missing = sorted(set(self._slots) - seen)
        if missing:
            names = [_hf_name(n, s) for n, s in missing]
            more = f" (+{len(names) - 1} more)" if len(names) > 1 else ""
            _refuse(where, f"tensor {names[0]!r} is missing{more}: an update must "
                    "provide every weight of the served model")

    def _entry(self, hf_name: str) -> tuple[list[tuple[str, int | None]], tuple[int, ...]]:
        """The (parameter, shard) keys a checkpoint tensor fills (none: skipped on purpose)
        and, for experts (one, or a layer's stacked ones), the full shape it must have."""
        src = experts.match(experts.canonical(hf_name))
        if src is None:
            key = self.resolve(hf_name)
            return ([] if key is None else [key]), ()
        param = self.params.get(src.param)
        if param is None or (src.expert is not None and src.expert >= param.shape[0]):
            return [(hf_name, None)], ()  # not in the layout: refused as unknown
        keys: list[tuple[str, int | None]] = sorted(src.keys(param.shape[0]))
        return keys, experts.full_shape(src, param, self.tp_size)

    def copy_tensor(self, reader: Any, hf_name: str, rank: int, where: str) -> int:
        """Copy this rank's slice of ``hf_name`` (checked) from ``reader`` (a safetensors
        reader, or ``TensorReader``) into its parameter; bytes the source held."""
        src = experts.match(experts.canonical(hf_name))
        if src is not None:  # one expert's projection, or a layer's stacked experts
            keys, shape = self._entry(hf_name)
            with torch.no_grad():
                experts.copy_expert(reader, hf_name, src, self.params[src.param], rank,
                                    self.tp_size, where)
            return TensorMeta(hf_name, shape, self._slots[keys[0]].dtype).nbytes
        key = self.resolve(hf_name)
        if key is None:
            return 0
        name, shard = key
        with torch.no_grad():
            copy_shard(reader, hf_name, name, self.target(name, shard), rank,
                       self.tp_size, where)
        slot = self._slots[key]
        return TensorMeta(hf_name, slot.shape, slot.dtype).nbytes


def _key(name: str, shard: int | None) -> str:
    return name if shard is None else f"{name}[{shard}]"


_FUSED_BACK = {("qkv_proj", 0): "q_proj", ("qkv_proj", 1): "k_proj", ("qkv_proj", 2): "v_proj",
               ("gate_up_proj", 0): "gate_proj", ("gate_up_proj", 1): "up_proj"}


def _hf_name(name: str, shard: int | None) -> str:
    """The Hugging Face name of our (parameter, shard), for messages."""
    if shard is not None and experts.is_stacked(name):
        return experts.hf_name(name, shard)
    if shard is not None:
        for (fused, i), part in _FUSED_BACK.items():
            if i == shard and f".{fused}." in name:
                name = name.replace(f".{fused}.", f".{part}.")
                break
    return name if name.startswith("lm_head.") else f"model.{name}"


def _refuse(field: str, description: str) -> NoReturn:
    raise InvalidRequest([FieldViolation(field, description)])


# -- sources -------------------------------------------------------------------------------
class TensorReader:
    """Whole tensors by name behind the part of the safetensors reader ``copy_shard`` uses
    (``get_slice(name)`` with ``get_shape()`` and slicing)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._tensors = tensors

    def keys(self) -> list[str]:
        return list(self._tensors)

    def get_slice(self, name: str) -> _Piece:
        return _Piece(self._tensors[name])


class _Piece:
    def __init__(self, tensor: torch.Tensor) -> None:
        self._t = tensor

    def get_shape(self) -> list[int]:
        return list(self._t.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self._t[index]


def directory_manifest(path: Path) -> tuple[list[TensorMeta], list[Path]]:
    """Every tensor of a Hugging Face directory's safetensors (headers only), and the
    files; INVALID_ARGUMENT (field ``path``) for a directory that is not one."""
    from executor.errors import ModelLoadError

    if not path.is_dir():
        _refuse("path", f"{str(path)!r} is not a directory on the server")
    try:
        files = _weight_files(path)
    except ModelLoadError as exc:
        _refuse("path", str(exc))
    manifest = []
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    piece = f.get_slice(name)
                    dtype = _ST_DTYPES.get(piece.get_dtype())
                    if dtype is None:
                        _refuse("path", f"tensor {name!r} in {file.name} is "
                                f"{piece.get_dtype()}; only floating weights update")
                    manifest.append(TensorMeta(name, tuple(piece.get_shape()), dtype))
        except (OSError, ValueError, RuntimeError) as exc:  # not a safetensors file
            _refuse("path", f"cannot read {file.name}: {exc}")
    return manifest, files


def directory_tensors(files: Sequence[Path]) -> Iterator[tuple[Any, str, str]]:
    """(reader, tensor name, file name) for every tensor of ``files``, one open file at a
    time."""
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118
                yield f, name, file.name


def reference_dtypes(files: Sequence[Path] | None) -> dict[str, torch.dtype] | None:
    """The served checkpoint's dtype per internal ``name[shard]`` (headers only); None for
    random weights (then the parameters' dtype is expected)."""
    if files is None:
        return None
    out: dict[str, torch.dtype] = {}
    for f, name, _ in directory_tensors(files):
        dtype = _ST_DTYPES.get(f.get_slice(name).get_dtype())
        if dtype is None or _IGNORED_RE.search(name):
            continue
        src = experts.match(experts.canonical(name))
        if src is not None:  # one dtype per stacked experts parameter
            out[_key(src.param, None)] = dtype
            continue
        param, shard = _internal_name(experts.canonical(name))
        out[_key(param, shard)] = dtype
    return out
