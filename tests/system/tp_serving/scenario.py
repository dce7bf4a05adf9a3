"""One scheduler session run against any server: what TP=N must reproduce of TP=1.

Two sequences prefilled in chunks (a first chunk that only fills the KV cache), decoded
together, then k steps in one call continuing from the tokens left on the device, one
rolled back with Truncate and decoded again, a prefill refused for lack of KV (nothing
applied), releases, the same prompt admitted again into the freed locations, a Session
with two steps in flight, two forks (whole and half) decoded on, and an every_position
prefill continued from its last token.
Every sampled token comes with its log-probability and top-5 alternatives.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from service.gen.model_executor.v1 import executor_pb2 as pb

LOGPROBS = pb.SamplingParams(logprobs=True, top_logprobs=5)
#: The pool of the ``tiny`` servers the scenario runs on: small enough that the prefill
#: of one token more than is free is refused for KV, not for the context.
KV_TOKENS = 160
#: ``serve`` flags of those servers (``conftest``'s shared TP = 1 and TP = 2 ones).
TINY = ["--model", "tiny", "--kv-tokens", str(KV_TOKENS), "--max-context", "128",
        "--max-sequences", "8", "--drain-delay", "0"]


@dataclass
class Transcript:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    # (seq_id, token, logprob, ((token, logprob), ...)) in the order they were sampled
    logprobs: list[tuple[str, int, float, tuple[tuple[int, float], ...]]] = field(
        default_factory=list)
    kv: list[tuple[int, int, int]] = field(default_factory=list)  # (total, free, active)
    refused: str = ""

    def take(self, seq_id: str, token: int, logprob: float,
             top: tuple[tuple[int, float], ...]) -> None:
        self.tokens.setdefault(seq_id, []).append(token)
        self.logprobs.append((seq_id, token, logprob, top))


def _top(entries: object) -> tuple[tuple[int, float], ...]:
    return tuple((int(e.token_id), float(e.logprob)) for e in entries)  # type: ignore[attr-defined]


def _kv(stub: object, out: Transcript) -> None:
    kv = stub.Health(pb.HealthRequest(), timeout=30).kv  # type: ignore[attr-defined]
    out.kv.append((kv.total_tokens, kv.free_tokens, kv.active_sequences))


def run(stub: object, prompt_a: list[int], prompt_b: list[int], decode_steps: int = 6,
        kv_tokens: int = 0) -> Transcript:
    s = stub  # an ExecutorStub
    out = Transcript()
    split = len(prompt_a) // 2
    first = s.Prefill(pb.PrefillRequest(items=[  # type: ignore[attr-defined]
        pb.PrefillItem(seq_id="a", token_ids=prompt_a[:split], sample=False),
        pb.PrefillItem(seq_id="b", token_ids=prompt_b, sample=True, sampling=LOGPROBS)]),
        timeout=120)
    assert not first.outputs[0].HasField("token_id")
    o = first.outputs[1]
    out.take("b", o.token_id, o.logprob, _top(o.top_logprobs))
    second = s.Prefill(pb.PrefillRequest(items=[  # type: ignore[attr-defined]
        pb.PrefillItem(seq_id="a", token_ids=prompt_a[split:], sample=True,
                       sampling=LOGPROBS)]), timeout=120)
    o = second.outputs[0]
    out.take("a", o.token_id, o.logprob, _top(o.top_logprobs))
    _kv(s, out)
    for _ in range(decode_steps):
        step = s.Decode(pb.DecodeRequest(items=[  # type: ignore[attr-defined]
            pb.DecodeItem(seq_id=sid, token_id=out.tokens[sid][-1], sampling=LOGPROBS)
            for sid in ("a", "b")]), timeout=120)
        for o in step.outputs:
            out.take(o.seq_id, o.token_id, o.logprob, _top(o.top_logprobs))
    # k steps in one call, each reading the previous one's tokens on the device(s)
    multi = s.Decode(pb.DecodeRequest(items=[  # type: ignore[attr-defined]
        pb.DecodeItem(seq_id=sid, use_last_sampled=True, sampling=LOGPROBS)
        for sid in ("a", "b")], num_steps=3), timeout=120)
    for o in multi.outputs:
        for t in o.steps:
            out.take(o.seq_id, t.token_id, t.logprob, _top(t.top_logprobs))
    _kv(s, out)
    # roll 'a' back by 4 tokens and continue from an explicit token
    length = len(prompt_a) + len(out.tokens["a"]) - 1 - 4
    s.Truncate(pb.TruncateRequest(seq_id="a", length=length), timeout=30)  # type: ignore[attr-defined]
    for _ in range(3):
        step = s.Decode(pb.DecodeRequest(items=[  # type: ignore[attr-defined]
            pb.DecodeItem(seq_id="a", token_id=out.tokens["a"][-1], sampling=LOGPROBS)]),
            timeout=120)
        o = step.outputs[0]
        out.take("a#truncated", o.token_id, o.logprob, _top(o.top_logprobs))
    _kv(s, out)
    if kv_tokens:  # more than the pool has free: refused, nothing applied
        free = out.kv[-1][1]
        try:
            s.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(  # type: ignore[attr-defined]
                seq_id="c", token_ids=[7] * (free + 1), sample=True)]), timeout=120)
        except grpc.RpcError as exc:
            out.refused = exc.code().name
        _kv(s, out)
    s.Release(pb.ReleaseRequest(seq_ids=["b"]), timeout=30)  # type: ignore[attr-defined]
    again = s.Prefill(pb.PrefillRequest(items=[  # type: ignore[attr-defined]
        pb.PrefillItem(seq_id="b2", token_ids=prompt_b, sample=True, sampling=LOGPROBS)]),
        timeout=120)
    o = again.outputs[0]
    out.take("b2", o.token_id, o.logprob, _top(o.top_logprobs))
    # a Session with two steps in flight, each continuing from the token the one before
    # it sampled, on the device(s): ranks other than 0 must have it too
    def steps() -> Iterator[pb.SessionRequest]:
        yield pb.SessionRequest(step=1, prefill=pb.PrefillRequest(items=[pb.PrefillItem(
            seq_id="p", token_ids=prompt_b[::-1], sample=True, sampling=LOGPROBS)]))
        for n in range(2, 7):
            yield pb.SessionRequest(step=n, decode=pb.DecodeRequest(items=[pb.DecodeItem(
                seq_id="p", use_last_sampled=True, sampling=LOGPROBS)]))

    for response in s.Session(steps(), timeout=120):  # type: ignore[attr-defined]
        kind = response.WhichOneof("result")
        assert kind in ("prefill", "decode"), response
        o = getattr(response, kind).outputs[0]
        out.take("p", o.token_id, o.logprob, _top(o.top_logprobs))
    # Fork: the child shares all of 'p' (and its last sampled token, on the device(s)) and
    # a second child shares half; each continues on its own
    s.Fork(pb.ForkRequest(parent_seq_id="p", child_seq_id="p-all"), timeout=30)  # type: ignore[attr-defined]
    half = (len(prompt_b) + 5) // 2
    s.Fork(pb.ForkRequest(parent_seq_id="p", child_seq_id="p-half",  # type: ignore[attr-defined]
                          prefix_len=half), timeout=30)
    step = s.Decode(pb.DecodeRequest(items=[  # type: ignore[attr-defined]
        pb.DecodeItem(seq_id="p-all", use_last_sampled=True, sampling=LOGPROBS),
        pb.DecodeItem(seq_id="p-half", token_id=11, sampling=LOGPROBS)], num_steps=3),
        timeout=120)
    for o in step.outputs:
        for t in o.steps:
            out.take(o.seq_id, t.token_id, t.logprob, _top(t.top_logprobs))
    _kv(s, out)
    # every_position: a token after each of the prompt's tokens (speculative verification)
    scored = s.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(  # type: ignore[attr-defined]
        seq_id="v", token_ids=prompt_b, sample=True, every_position=True,
        sampling=LOGPROBS)]), timeout=120)
    for t in scored.outputs[0].positions:
        out.take("v", t.token_id, t.logprob, _top(t.top_logprobs))
    step = s.Decode(pb.DecodeRequest(items=[pb.DecodeItem(  # type: ignore[attr-defined]
        seq_id="v", use_last_sampled=True, sampling=LOGPROBS)]), timeout=120)
    o = step.outputs[0]
    out.take("v", o.token_id, o.logprob, _top(o.top_logprobs))
    s.Release(pb.ReleaseRequest(  # type: ignore[attr-defined]
        seq_ids=["a", "b2", "p", "p-all", "p-half", "v"]), timeout=30)
    _kv(s, out)
    return out


def assert_same(got: Transcript, want: Transcript, atol: float) -> float:
    """Same tokens and KV accounting; log-probabilities within ``atol`` (all-reduce order
    changes float32 rounding). Returns the largest difference seen."""
    assert got.tokens == want.tokens
    assert got.kv == want.kv and got.refused == want.refused
    worst = 0.0
    for (sid, tok, lp, top), (wsid, wtok, wlp, wtop) in zip(got.logprobs, want.logprobs,
                                                            strict=True):
        assert (sid, tok) == (wsid, wtok)
        worst = max(worst, abs(lp - wlp))
        # alternatives within atol of each other may swap places: compare by token
        wmap = dict(wtop)
        for t, v in top:
            if t in wmap:
                worst = max(worst, abs(v - wmap[t]))
            else:  # a near tie at the 5th place
                assert abs(v - wtop[-1][1]) <= atol, (sid, top, wtop)
    assert worst <= atol, f"largest log-probability difference {worst}"
    print(f"largest log-probability difference: {worst:.3g}")
    return worst
