"""Sampling parameters from their messages (``convert.py``'s request side).

Range errors go to the caller's ``Violations`` (the executor's definitions, so every client
gets the same messages); an item's extra outputs (candidate tokens, hidden states) travel
with its sampling parameters inside the executor.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from executor import sampling_violations
from executor.api import GREEDY, Grammar, LogprobsMode, SamplingParams
from executor.errors import FieldViolation
from service.gen.model_executor.v1 import executor_pb2 as pb


class Violations(Protocol):
    items: list[FieldViolation]

    def add(self, field: str, description: str) -> None: ...


def sampling_params(msg: pb.SamplingParams | None, field: str, out: Violations
                    ) -> SamplingParams:
    """``msg`` as executor params (unset fields mean off); range errors go to ``out``."""
    if msg is None:
        return GREEDY
    mode = _LOGPROBS_MODES.get(msg.logprobs_mode)
    if mode is None:
        out.add(f"{field}.logprobs_mode", f"unknown LogprobsMode value {msg.logprobs_mode}")
    grammar_kind = msg.grammar.WhichOneof("kind") if msg.HasField("grammar") else None
    params = SamplingParams(
        temperature=msg.temperature, top_k=msg.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0, min_p=msg.min_p,
        seed=msg.seed if msg.HasField("seed") else None, logprobs=msg.logprobs,
        top_logprobs=msg.top_logprobs,
        allowed_token_bitmask=msg.allowed_token_bitmask or None,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        grammar=None if grammar_kind is None else
        Grammar(grammar_kind, getattr(msg.grammar, grammar_kind)),  # type: ignore[arg-type]
        logprobs_mode=mode or "raw")
    # The ranges are the executor's: one definition, the same messages for every client.
    out.items.extend(sampling_violations(params, field))
    return params


#: ``pb.LogprobsMode`` values as the executor names them.
_LOGPROBS_MODES: dict[int, LogprobsMode] = {
    pb.LOGPROBS_MODE_UNSPECIFIED: "raw", pb.LOGPROBS_MODE_RAW: "raw",
    pb.LOGPROBS_MODE_PROCESSED: "processed"}


def sampling_of(item: pb.PrefillItem | pb.DecodeItem, field: str, out: Violations
                 ) -> SamplingParams:
    """The item's sampling, with the item's extra outputs (which the executor carries
    with its sampling parameters)."""
    msg = item.sampling if item.HasField("sampling") else None
    params = sampling_params(msg, f"{field}.sampling", out)
    if item.candidate_token_ids or item.return_hidden_state:
        params = dataclasses.replace(params, candidate_token_ids=tuple(item.candidate_token_ids),
                                     return_hidden_state=item.return_hidden_state)
    return params


def has_sampling(item: pb.DecodeItem) -> bool:
    """Whether a decode item needs its own parameters (else it is GREEDY)."""
    return item.HasField("sampling") or bool(item.candidate_token_ids) or \
        item.return_hidden_state
