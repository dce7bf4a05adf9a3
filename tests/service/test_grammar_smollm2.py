"""Grammars on the real SmolLM2-135M-Instruct (CPU, float32) over gRPC: JSON schemas,
regexes and EBNF grammars, greedy and T = 1, through unary Prefill/Decode, a pipelined
Session continuing from the device's last samples, and ``num_steps`` 8; every output
parses and validates (``jsonschema``). Every case runs through every path: a path's cases
are one batch (a decode step's cost grows slowly with its batch), forked from three
prompts prefilled once, each decoded until its grammar completes. Forked children continue
valid output; a truncated sequence resumes a valid parse. Also: a grammar that does not
compile, and an item's own mask that leaves none of its grammar's tokens.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import numpy as np
import pytest

from executor.config import CacheConfig, ExecutorConfig, ModelConfig
from executor.weights.catalog import converted_dir
from service.gen.model_executor.v1 import executor_pb2 as pb
from tests.service.harness import ServerHarness

NAME = "smollm2-135m"
MAX_NEW = 40  # every case completes well within this (bounded strings, small objects)

_INT = {"type": "integer", "minimum": 0, "maximum": 99}
_NAME = {"type": "string", "maxLength": 6}
_COLOR = {"enum": ["red", "green", "blue"]}


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": required or list(props),
            "additionalProperties": False}


SCHEMAS: list[dict[str, Any]] = [
    _obj({"name": _NAME, "age": _INT}),
    _obj({"color": _COLOR}),
    _obj({"ok": {"type": "boolean"}}),
    _obj({"n": {"type": "integer", "minimum": -5, "maximum": 5}}),
    _obj({"tags": {"type": "array", "items": _COLOR, "minItems": 1, "maxItems": 2}}),
    _obj({"point": _obj({"x": _INT, "y": _INT})}),
    _obj({"user": _obj({"name": _NAME, "color": _COLOR})}),
    _obj({"id": _INT, "active": {"type": "boolean"}}, ["id"]),
    {"type": "array", "items": _INT, "minItems": 1, "maxItems": 3},
    {"enum": ["yes", "no", "maybe"]},
    _obj({"level": {"enum": [1, 2, 3]}}),
    _obj({"a": _obj({"b": _obj({"c": _INT})})}),
    _obj({"size": {"enum": ["S", "M", "L"]}, "count": _INT}),
    _obj({"pair": {"type": "array", "items": _INT, "minItems": 2, "maxItems": 2}}),
    {"type": "integer", "minimum": 10, "maximum": 20},
    _obj({"name": _NAME, "tags": {"type": "array", "items": _NAME, "maxItems": 1}}),
    _obj({"flag": {"type": "boolean"}, "color": _COLOR}),
    _obj({"r": _obj({"ok": {"type": "boolean"}})}),
    {"type": "boolean"},
    _obj({"k": {"type": "null"}}),
]
REGEXES = [r"[a-c]{2,4}", r"(cat|dog|bird)-[0-9]"]
EBNFS = ['root ::= "yes" | "no"', 'root ::= "(" [0-9] ("+" [0-9])? ")"']


def _cases() -> list[tuple[str, pb.Grammar, Any]]:
    """(label, grammar, check(text) -> None)."""
    out: list[tuple[str, pb.Grammar, Any]] = []
    for k, schema in enumerate(SCHEMAS):
        out.append((f"j{k}", pb.Grammar(json_schema=json.dumps(schema)),
                    lambda text, s=schema: jsonschema.validate(json.loads(text), s)))
    for k, rx in enumerate(REGEXES):
        out.append((f"r{k}", pb.Grammar(regex=rx),
                    lambda text, rx=rx: _assert(re.fullmatch(rx, text), text)))
    out.append(("e0", pb.Grammar(ebnf=EBNFS[0]), lambda text: _assert(text in ("yes", "no"),
                                                                       text)))
    out.append(("e1", pb.Grammar(ebnf=EBNFS[1]),
                lambda text: _assert(re.fullmatch(r"\(\d(\+\d)?\)", text), text)))
    return out


def _assert(ok: object, text: str) -> None:
    assert ok, text


CASES = _cases()


@pytest.fixture(scope="module")
def tokenizer(smollm2_cache: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(converted_dir(NAME, smollm2_cache)))


@pytest.fixture(scope="module")
def server(smollm2_cache: Path) -> Iterator[ServerHarness]:
    n = 2 * len(CASES) + 8  # a path's items, the prompts, the fork test's sequences
    config = ExecutorConfig(model=ModelConfig(source=NAME, dtype="float32"), device="cpu",
                            cache=CacheConfig(kv_tokens=8192, max_sequences=n,
                                              max_context=256),
                            max_prefill_tokens=8192, max_decode_batch=n)
    harness = ServerHarness(config)
    try:
        harness.wait_ready(timeout=300)
        yield harness
    finally:
        harness.close()


def _prompt(tokenizer: Any, kind: str) -> list[int]:
    what = {"j": "a JSON value", "r": "a short code", "e": "an answer"}[kind]
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Reply with {what} only."}], add_generation_prompt=True,
        tokenize=True, return_dict=True)
    return list(encoded["input_ids"])


@pytest.fixture(scope="module")
def prompts(server: ServerHarness, tokenizer: Any) -> Iterator[dict[str, list[int]]]:
    """The three prompts (by case kind), all but their last token prefilled once as
    sequences ``p<kind>`` that every path's items fork from (a shared system prompt)."""
    out = {kind: _prompt(tokenizer, kind) for kind in "jre"}
    server.stub.Prefill(pb.PrefillRequest(items=[
        pb.PrefillItem(seq_id=f"p{kind}", token_ids=ids[:-1], sample=False)
        for kind, ids in out.items()]), timeout=120)
    yield out
    server.stub.Release(pb.ReleaseRequest(seq_ids=[f"p{kind}" for kind in out]), timeout=60)


def _sampling(grammar: pb.Grammar, temperature: float, seed: int) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=temperature, seed=seed, grammar=grammar)


PATHS = ("unary", "session", "num_steps")


def _items(path: str) -> list[tuple[str, pb.SamplingParams, Any]]:
    """(seq_id, sampling, check): every case, greedy and at T = 1."""
    return [(f"{path[0]}{label}-{t}", _sampling(g, t, 7 + i), check)
            for i, (label, g, check) in enumerate(CASES) for t in (0.0, 1.0)]


def _kind(seq_id: str) -> str:
    return seq_id[1]


def _text(tokenizer: Any, tokens: list[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=True)


def _prefill(server: ServerHarness, prompts: dict[str, list[int]],
             items: list[tuple[str, pb.SamplingParams, Any]]) -> dict[str, list[int]]:
    """Fork each item from its prompt, then one Prefill of every item's last prompt token
    (its grammar starts there) samples each one's first token."""
    for s, _, _ in items:
        server.stub.Fork(pb.ForkRequest(parent_seq_id=f"p{_kind(s)}", child_seq_id=s),
                         timeout=60)
    req = pb.PrefillRequest(items=[pb.PrefillItem(
        seq_id=s, token_ids=prompts[_kind(s)][-1:], sample=True, sampling=p)
        for s, p, _ in items])
    return {o.seq_id: [o.token_id] for o in server.stub.Prefill(req, timeout=120).outputs}


def _collect(outputs: Any, tokens: dict[str, list[int]], done: set[str]) -> None:
    for o in outputs:
        if o.seq_id in done:
            continue
        steps = [s.token_id for s in o.steps] or [o.token_id]
        tokens[o.seq_id] += steps
        if o.grammar_completed:
            done.add(o.seq_id)


def _check_all(tokenizer: Any, items: list[tuple[str, pb.SamplingParams, Any]],
               tokens: dict[str, list[int]], done: set[str]) -> None:
    missing = [s for s, _, _ in items if s not in done]
    assert not missing, {s: _text(tokenizer, tokens[s]) for s in missing}
    for s, _, check in items:
        check(_text(tokenizer, tokens[s]).strip() if _kind(s) == "j" else
              _text(tokenizer, tokens[s]))


@pytest.mark.parametrize("path", PATHS)
def test_grammar_outputs_always_parse(server: ServerHarness, tokenizer: Any,
                                      prompts: dict[str, list[int]], path: str) -> None:
    """Every case, greedy and T = 1, in one batch through ``path``; a completed item
    leaves the batch (in the Session, from the first request sent after its answer)."""
    items = _items(path)
    ids = [s for s, _, _ in items]
    try:
        tokens = _prefill(server, prompts, items)
        done = _decode(server, path, items, tokens)
        _check_all(tokenizer, items, tokens, done)
    finally:  # (a failed path leaves the slots to the next one)
        server.stub.Release(pb.ReleaseRequest(seq_ids=ids), timeout=60)


def _decode(server: ServerHarness, path: str, items: list[tuple[str, pb.SamplingParams, Any]],
            tokens: dict[str, list[int]]) -> set[str]:
    """Decode ``items`` through ``path`` until every grammar completes (or MAX_NEW tokens),
    appending to ``tokens``; returns the completed ids."""
    done: set[str] = set()
    ids = [s for s, _, _ in items]
    by_id = {s: p for s, p, _ in items}

    def decode(num_steps: int = 1) -> pb.DecodeRequest:
        return pb.DecodeRequest(num_steps=num_steps, items=[pb.DecodeItem(
            seq_id=s, use_last_sampled=True, sampling=by_id[s])
            for s in ids if s not in done])

    if path == "session":  # two steps in flight, each continuing from the device's samples
        in_flight = threading.Semaphore(2)

        def requests() -> Iterator[pb.SessionRequest]:
            for k in range(MAX_NEW):
                in_flight.acquire()
                if len(done) == len(ids):
                    return
                yield pb.SessionRequest(step=k + 1, decode=decode())

        for answer in server.stub.Session(requests(), timeout=300):
            assert answer.WhichOneof("result") == "decode", answer.error.message
            _collect(answer.decode.outputs, tokens, done)
            in_flight.release()
        return done
    num_steps = 8 if path == "num_steps" else 1
    for _ in range(MAX_NEW // num_steps):
        if len(done) == len(ids):
            break
        _collect(server.stub.Decode(decode(num_steps), timeout=120).outputs, tokens, done)
    return done


def test_fork_and_truncate_keep_the_parse(server: ServerHarness, tokenizer: Any) -> None:
    """A JSON item decodes 3 tokens, forks (T = 1, other seeds) and both finish valid;
    another is truncated back 2 tokens and resumes, giving its token, to a valid parse."""
    schema = SCHEMAS[0]
    g = pb.Grammar(json_schema=json.dumps(schema))
    prompt = _prompt(tokenizer, "j")
    stub = server.stub
    first = stub.Prefill(pb.PrefillRequest(items=[
        pb.PrefillItem(seq_id="par", token_ids=prompt, sample=True,
                       sampling=_sampling(g, 1.0, 1)),
        pb.PrefillItem(seq_id="tr", token_ids=prompt, sample=True,
                       sampling=_sampling(g, 0.0, 0))]), timeout=60).outputs
    toks = {o.seq_id: [o.token_id] for o in first}
    out = stub.Decode(pb.DecodeRequest(num_steps=3, items=[
        pb.DecodeItem(seq_id=s, use_last_sampled=True, sampling=_sampling(g, t, 1))
        for s, t in (("par", 1.0), ("tr", 0.0))]), timeout=60).outputs
    for o in out:
        toks[o.seq_id] += [s.token_id for s in o.steps]
    stub.Fork(pb.ForkRequest(parent_seq_id="par", child_seq_id="kid"), timeout=60)
    toks["kid"] = list(toks["par"])
    # Truncate "tr" to keep 2 of its output tokens in the cache; resume from the third.
    keep = len(prompt) + 2
    stub.Truncate(pb.TruncateRequest(seq_id="tr", length=keep), timeout=60)
    resume = toks["tr"][2]
    toks["tr"] = toks["tr"][:3]
    done: set[str] = set()
    items = [pb.DecodeItem(seq_id="par", use_last_sampled=True, sampling=_sampling(g, 1.0, 2)),
             pb.DecodeItem(seq_id="kid", use_last_sampled=True, sampling=_sampling(g, 1.0, 3)),
             pb.DecodeItem(seq_id="tr", token_id=resume, sampling=_sampling(g, 0.0, 0))]
    _collect(stub.Decode(pb.DecodeRequest(num_steps=8, items=items), timeout=60).outputs,
             toks, done)
    for _ in range(4):
        live = [pb.DecodeItem(seq_id=i.seq_id, use_last_sampled=True, sampling=i.sampling)
                for i in items if i.seq_id not in done]
        if not live:
            break
        _collect(stub.Decode(pb.DecodeRequest(num_steps=8, items=live), timeout=60).outputs,
                 toks, done)
    assert done == {"par", "kid", "tr"}, {s: _text(tokenizer, t) for s, t in toks.items()}
    for s in ("par", "kid", "tr"):
        jsonschema.validate(json.loads(_text(tokenizer, toks[s])), schema)
    stub.Release(pb.ReleaseRequest(seq_ids=["par", "kid", "tr"]), timeout=60)


def test_grammar_that_does_not_compile_is_invalid_argument(server: ServerHarness) -> None:
    before = server.kv().free_tokens
    with pytest.raises(grpc.RpcError) as err:
        server.stub.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(
            seq_id="bad", token_ids=[1, 2], sample=True,
            sampling=pb.SamplingParams(grammar=pb.Grammar(regex="(unclosed")))]), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "items[0].sampling.grammar.regex" in (err.value.details() or "")
    assert server.kv().free_tokens == before


def _bitmask(ids: list[int], vocab: int) -> bytes:
    bits = np.zeros(((vocab + 31) // 32) * 32, dtype=np.uint8)
    bits[ids] = 1
    return np.packbits(bits, bitorder="little").tobytes()


def test_an_own_mask_that_leaves_no_grammar_token(server: ServerHarness, tokenizer: Any,
                                                  prompts: dict[str, list[int]]) -> None:
    """The item's allowed_token_bitmask and its grammar's mask intersected: empty at a
    call's first sampled position is INVALID_ARGUMENT before anything is allocated (a
    prefill's start, a decode after its sequence's tokens); empty at a later device step
    of a multi-step decode ends the item's steps before it (neither stopped nor complete),
    and the next decode is refused; so is a pipelined Session step whose mask depends on
    the step still in flight."""
    vocab = len(tokenizer)
    cat, dog, dash, one = (tokenizer.encode(w, add_special_tokens=False)[0]
                           for w in ("cat", "dog", "-", "1"))
    g = pb.Grammar(regex=r"(cat|dog)-[0-9]")

    def params(ids: list[int]) -> pb.SamplingParams:
        return pb.SamplingParams(grammar=g, allowed_token_bitmask=_bitmask(ids, vocab))

    stub, free = server.stub, server.kv().free_tokens
    stub.Fork(pb.ForkRequest(parent_seq_id="pr", child_seq_id="own"), timeout=60)
    last = prompts["r"][-1:]
    with pytest.raises(grpc.RpcError) as err:  # the grammar starts with cat or dog only
        stub.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(
            seq_id="own", token_ids=last, sample=True, sampling=params([dash, one]))]),
            timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "items[0].sampling.allowed_token_bitmask" in (err.value.details() or "")
    assert server.kv().free_tokens == free
    out = stub.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(
        seq_id="own", token_ids=last, sample=True, sampling=params([cat, dog, dash]))]),
        timeout=60).outputs[0]
    assert out.token_id in (cat, dog)
    free = server.kv().free_tokens
    with pytest.raises(grpc.RpcError) as err:  # the grammar wants "-" now
        stub.Decode(pb.DecodeRequest(items=[pb.DecodeItem(
            seq_id="own", use_last_sampled=True, sampling=params([cat, dog]))]), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "items[0].sampling.allowed_token_bitmask" in (err.value.details() or "")
    assert server.kv().free_tokens == free
    # "-" is allowed at step 0, and no digit at step 1: the steps end after "-".
    out = stub.Decode(pb.DecodeRequest(num_steps=4, items=[pb.DecodeItem(
        seq_id="own", use_last_sampled=True, sampling=params([cat, dog, dash]))]),
        timeout=60).outputs[0]
    assert [s.token_id for s in out.steps] == [dash]
    assert not out.stopped and not out.grammar_completed
    with pytest.raises(grpc.RpcError) as err:
        stub.Decode(pb.DecodeRequest(items=[pb.DecodeItem(
            seq_id="own", token_id=one, sampling=params([cat, dog, dash]))]), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # The matcher stayed after "-" (it took none of the dropped steps): the digits next.
    assert "none of the 10 tokens" in (err.value.details() or "")
    # Pipelined: step 2 is sent before step 1's "-" reaches the host; its admission waits
    # for it and refuses the step (the Session goes on).
    stub.Fork(pb.ForkRequest(parent_seq_id="pr", child_seq_id="own2"), timeout=60)
    stub.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(
        seq_id="own2", token_ids=last, sample=True, sampling=params([cat, dog, dash]))]),
        timeout=60)
    step = pb.DecodeRequest(items=[pb.DecodeItem(
        seq_id="own2", use_last_sampled=True, sampling=params([cat, dog, dash]))])
    answers = list(stub.Session(iter([pb.SessionRequest(step=k, decode=step)
                                      for k in (1, 2)]), timeout=120))
    assert answers[0].decode.outputs[0].token_id == dash
    assert answers[1].error.code_name == "INVALID_ARGUMENT"
    assert "items[0].sampling.allowed_token_bitmask" in answers[1].error.message
    stub.Release(pb.ReleaseRequest(seq_ids=["own", "own2"]), timeout=60)
