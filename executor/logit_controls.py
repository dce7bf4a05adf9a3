"""``SlotControls``: each request slot's token mask and logit bias, on the device.

Static tables, one row per request slot (fixed addresses, so a captured decode graph
reads them as it reads ``LastSampled.tokens``):

* ``allowed`` (slots, words) int32: xgrammar's bitmask layout, bit j of word i allows token
  32 i + j; all ones for a slot without a mask;
* ``bias_ids`` / ``bias_vals`` (slots, MAX_LOGIT_BIAS): sparse logit bias (zeros: a no-op);
* ``active`` (slots,) int32: 1 where a slot has a mask or a bias. The CUDA kernel returns
  at once for an inactive row, so an unmasked batch costs one tiny launch.

The host writes a slot's row only when what it holds changes (``stage``); ``apply`` masks
(disallowed tokens become -inf) and biases logits rows in place, each row by its slot.
Only the real vocabulary is covered: the logits are ``compute_logits``'s, already trimmed
of any vocabulary-parallel padding.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from executor.api import MAX_LOGIT_BIAS, SamplingParams, distinct_params
from executor.model.layers import triton_available

_HAS_TRITON = triton_available()
#: A slot's state as the host last wrote it: (mask bytes or None, bias pairs).
_SlotState = tuple[bytes | None, tuple[tuple[int, float], ...]]


def mask_words(vocab: int) -> int:
    """int32 words of a bitmask over ``vocab`` tokens."""
    return (vocab + 31) // 32


def unpack_bitmask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """(rows, words) int32 -> (rows, vocab) bool, True where the token is allowed."""
    shifts = torch.arange(32, device=words.device, dtype=torch.int32)
    bits = (words[:, :, None] >> shifts) & 1  # (rows, words, 32)
    return bits.reshape(words.shape[0], -1)[:, :vocab].bool()


def bitmask_allows(mask: bytes | np.ndarray, vocab: int) -> np.ndarray:
    """The tokens a mask allows, on the host (validation and tests): (vocab,) bool."""
    words = np.frombuffer(mask, dtype="<i4")
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")
    return bits[:vocab].astype(bool)


def bitmask_allows_any(mask: bytes, vocab: int) -> bool:
    """Whether a mask of the right length allows any token of the vocabulary: whole words
    tested at once, the partial last word under its vocabulary bits (no unpacking)."""
    words = np.frombuffer(mask, dtype="<i4")
    full, rest = divmod(vocab, 32)
    return bool(words[:full].any()) or (
        rest > 0 and int(words[full]) & ((1 << rest) - 1) != 0)


class SlotControls:
    def __init__(self, max_sequences: int, vocab: int, device: torch.device) -> None:
        self.vocab, self.device = vocab, device
        self.words = mask_words(vocab)
        self.active = torch.zeros(max_sequences, dtype=torch.int32, device=device)
        self.allowed = torch.full((max_sequences, self.words), -1, dtype=torch.int32,
                                  device=device)
        self.bias_ids = torch.zeros(max_sequences, MAX_LOGIT_BIAS, dtype=torch.int64,
                                    device=device)
        self.bias_vals = torch.zeros(max_sequences, MAX_LOGIT_BIAS, dtype=torch.float32,
                                     device=device)
        self._held: dict[int, _SlotState] = {}  # slots whose row is not the default
        self._stages: list[_Staging] = []  # made at the first write
        self._turn = 0

    def stage(self, slots: Sequence[int], params: Sequence[SamplingParams],
              masks: Sequence[bytes | None] | None = None, any_controls: bool = True
              ) -> bool:
        """Make each row's slot hold that row's controls: its params' mask (or ``masks``'
        entry, a grammar's mask for this step, when not None) and bias; a slot that held
        controls and whose row has none goes back to the default. Writes only what
        changed (queued on the current stream: no host sync). Returns whether any row
        has controls (the caller applies them). ``any_controls=False``: the caller knows
        no row has its own mask or bias (no scan then)."""
        if not self._held and masks is None and not (any_controls and any(
                p.has_controls for p in distinct_params(params))):
            return False
        changed: dict[int, _SlotState] = {}
        any_active = False
        for i, (slot, p) in enumerate(zip(slots, params, strict=True)):
            mask = masks[i] if masks is not None and masks[i] is not None \
                else p.allowed_token_bitmask
            state: _SlotState = (mask, p.logit_bias)
            any_active |= mask is not None or bool(p.logit_bias)
            if self._held.get(slot, (None, ())) != state:
                changed[slot] = state
        if changed:
            self._write(changed)
        return any_active

    def _next_stage(self) -> _Staging:
        if not self._stages:
            self._stages = [_Staging(self.active.shape[0], self.words, self.device)
                            for _ in range(2)]
        stage = self._stages[self._turn]
        self._turn ^= 1
        stage.wait()
        return stage

    def _write(self, changed: dict[int, _SlotState]) -> None:
        n = len(changed)
        stage = self._next_stage()
        allowed, ids = stage.allowed[:n].numpy(), stage.ids[:n].numpy()
        vals, active = stage.vals[:n].numpy(), stage.active[:n].numpy()
        ids.fill(0)
        vals.fill(0)
        stage.index[:n].numpy()[:] = list(changed)
        for r, (slot, (mask, bias)) in enumerate(changed.items()):
            if mask is not None:
                allowed[r] = np.frombuffer(mask, dtype="<i4")
            else:
                allowed[r] = -1
            for k, (tok, b) in enumerate(bias):
                ids[r, k], vals[r, k] = tok, b
            active[r] = mask is not None or bool(bias)
            if active[r]:
                self._held[slot] = (mask, bias)
            else:
                self._held.pop(slot, None)
        index = stage.index[:n].to(self.device, non_blocking=True)
        for table, host in ((self.allowed, stage.allowed), (self.bias_ids, stage.ids),
                            (self.bias_vals, stage.vals), (self.active, stage.active)):
            table.index_copy_(0, index, host[:n].to(self.device, non_blocking=True))
        stage.written()

    def apply(self, logits: torch.Tensor, slots: torch.Tensor) -> None:
        """Mask and bias ``logits`` (rows, vocab) in place, row r by ``slots[r]``'s
        controls (a slot past the tables' rows must not occur)."""
        if logits.is_cuda and _HAS_TRITON and logits.stride(-1) == 1:
            from executor.kernels.logit_controls import apply_controls

            apply_controls(logits, slots, self.active, self.allowed, self.bias_ids,
                           self.bias_vals)
            return
        apply_controls_torch(logits, slots, self.active, self.allowed, self.bias_ids,
                             self.bias_vals)


def apply_controls_torch(logits: torch.Tensor, slots: torch.Tensor, active: torch.Tensor,
                         allowed: torch.Tensor, bias_ids: torch.Tensor,
                         bias_vals: torch.Tensor) -> None:
    """``SlotControls.apply`` in torch ops (the reference; CPU). Inactive rows hold
    all-ones masks and zero biases, so applying them changes nothing."""
    vocab = logits.shape[-1]
    keep = unpack_bitmask(allowed.index_select(0, slots), vocab)
    logits.masked_fill_(~keep, float("-inf"))
    vals = bias_vals.index_select(0, slots).to(logits.dtype)
    logits.scatter_add_(1, bias_ids.index_select(0, slots), vals)


class _Staging:
    """The host side of one write: the changed rows, pinned on CUDA (copies from them are
    asynchronous) and kept: a fresh array per step costs more, in page faults and in
    pinning, than the copy itself. Two alternate; one is refilled only once the device has
    read it (its event, long past in practice)."""

    def __init__(self, rows: int, words: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.index = torch.empty(rows, dtype=torch.int64, pin_memory=pin)
        self.allowed = torch.empty((rows, words), dtype=torch.int32, pin_memory=pin)
        self.ids = torch.empty((rows, MAX_LOGIT_BIAS), dtype=torch.int64, pin_memory=pin)
        self.vals = torch.empty((rows, MAX_LOGIT_BIAS), dtype=torch.float32, pin_memory=pin)
        self.active = torch.empty(rows, dtype=torch.int32, pin_memory=pin)
        self._read = torch.cuda.Event() if pin else None
        self._pending = False

    def wait(self) -> None:
        if self._read is not None and self._pending:
            self._read.synchronize()
            self._pending = False

    def written(self) -> None:
        """The copies from this staging are queued (on the current stream)."""
        if self._read is not None:
            self._read.record()
            self._pending = True
