"""``model-executor client generate``: one sequence from prompt to stop, for debugging.

Two modes: ``--tokens 1,2,3`` prints the generated token ids as JSON (as every client
command prints); ``--prompt TEXT [--chat]`` tokenizes with the served model's tokenizer and
prints the text as it decodes, stopping at the model's end-of-sequence token.

The sequence id is unique per run (two runs never share KV state), and the sequence is
released on every way out: success, an error status (a failed Prefill too: a call that
passed the client's deadline may still have run on the server), Ctrl-C. The Release gets
its own deadline, so a run that failed on its deadline can still clean up.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

import grpc

from service.gen.model_executor.v1 import executor_pb2 as pb
from service.gen.model_executor.v1 import executor_pb2_grpc as pb_grpc

RELEASE_TIMEOUT_S = 10.0
# --max-new-tokens when not given: a prompt usually ends at EOS well before this.
DEFAULT_NEW_TOKENS = {"tokens": 16, "prompt": 256}


class GenerateError(Exception):
    """The run cannot start (no tokenizer, bad flags); the message says what to do."""


class StepFailed(Exception):
    """A Session step failed on the server: what the unary call would have raised (the
    client reports it as it reports a failed call)."""

    def __init__(self, error: pb.StepError) -> None:
        super().__init__(f"step failed: {error.code_name}: {error.message}")
        self.error = error


def new_seq_id() -> str:
    return f"client-generate-{uuid.uuid4().hex[:12]}"


def generate(stub: pb_grpc.ExecutorStub, a: argparse.Namespace,
             sampling: pb.SamplingParams) -> dict[str, Any] | None:
    """Run one sequence; the JSON result in token mode, None in prompt mode (printed)."""
    seq_id = a.seq_id or new_seq_id()
    if a.max_new_tokens is None:
        a.max_new_tokens = DEFAULT_NEW_TOKENS["tokens" if a.prompt is None else "prompt"]
    if a.max_new_tokens < 1:
        raise GenerateError("--max-new-tokens must be at least 1")
    if a.prompt is None:
        if a.chat or a.tokenizer:
            raise GenerateError("--chat and --tokenizer apply only with --prompt")
        started = time.perf_counter()
        tokens, stop = _run(stub, a, seq_id, _token_ids(a.tokens), sampling, set(), None)
        seconds = time.perf_counter() - started
        return {"seq_id": seq_id, "token_ids": tokens, "stop": stop,
                "tokens_per_s": round(len(tokens) / seconds, 1) if seconds > 0 else None}
    tokenizer, stop_ids = load_tokenizer(stub, a)  # before anything is admitted
    prompt = encode(tokenizer, a.prompt, a.chat)
    stream = TextStream(tokenizer, sys.stdout)
    started = time.perf_counter()
    try:
        tokens, stop = _run(stub, a, seq_id, prompt, sampling, stop_ids, stream.push)
    finally:
        stream.close()
    seconds = time.perf_counter() - started
    rate = f", {len(tokens) / seconds:.1f} tokens/s" if seconds > 0 else ""
    mode = f", pipelined {a.pipeline} deep" if a.pipeline else ""
    print(f"[{len(prompt)} prompt tokens, {len(tokens)} generated in {seconds:.2f} s{rate}"
          f"{mode}, stopped at {stop}; seq_id {seq_id}]", file=sys.stderr)
    return None


def _run(stub: pb_grpc.ExecutorStub, a: argparse.Namespace, seq_id: str, prompt: list[int],
         sampling: pb.SamplingParams, stop_ids: set[int],
         on_token: Callable[[int], None] | None) -> tuple[list[int], str]:
    """Prefill, then Decode until a stop token or --max-new-tokens; always Release.
    With ``--pipeline N``, the steps go over one Session, N in flight (``_session``)."""
    if a.pipeline:
        return _session(stub, a, seq_id, prompt, sampling, stop_ids, on_token)

    def rid(suffix: str) -> str:  # a request_id names one call (retries are deduplicated)
        return f"{a.request_id}-{suffix}" if a.request_id else ""

    tokens: list[int] = []
    try:
        step = stub.Prefill(pb.PrefillRequest(request_id=rid("prefill"), items=[pb.PrefillItem(
            seq_id=seq_id, token_ids=prompt, sample=True, sampling=sampling)]),
            timeout=a.timeout)
        while True:
            tokens.append(step.outputs[0].token_id)
            if on_token is not None:
                on_token(tokens[-1])
            if tokens[-1] in stop_ids or len(tokens) >= a.max_new_tokens:
                break
            step = stub.Decode(pb.DecodeRequest(request_id=rid(f"decode-{len(tokens)}"), items=[
                pb.DecodeItem(seq_id=seq_id, token_id=tokens[-1], sampling=sampling)]),
                timeout=a.timeout)
    except BaseException:  # an error status, a deadline, Ctrl-C: release, then re-raise
        release(stub, seq_id, a.timeout, quiet=True)
        raise
    release(stub, seq_id, a.timeout, quiet=False)
    return tokens, "eos" if tokens and tokens[-1] in stop_ids else "length"


def _session(stub: pb_grpc.ExecutorStub, a: argparse.Namespace, seq_id: str,
             prompt: list[int], sampling: pb.SamplingParams, stop_ids: set[int],
             on_token: Callable[[int], None] | None) -> tuple[list[int], str]:
    """The same over a Session: each decode step is sent before the previous one is
    answered (up to ``a.pipeline`` in flight) and continues from the token its sequence
    sampled last, on the server's device. Steps already sent past a stop are discarded;
    the Release frees their KV too."""
    window = threading.Semaphore(a.pipeline)
    done = threading.Event()

    def requests() -> Iterator[pb.SessionRequest]:
        window.acquire()
        yield pb.SessionRequest(step=1, prefill=pb.PrefillRequest(items=[pb.PrefillItem(
            seq_id=seq_id, token_ids=prompt, sample=True, sampling=sampling)]))
        for step in range(2, a.max_new_tokens + 1):
            window.acquire()
            if done.is_set():
                return
            yield pb.SessionRequest(step=step, decode=pb.DecodeRequest(items=[pb.DecodeItem(
                seq_id=seq_id, use_last_sampled=True, sampling=sampling)]))

    tokens: list[int] = []
    call = stub.Session(requests(), timeout=a.timeout * a.max_new_tokens)
    try:
        for response in call:
            kind = response.WhichOneof("result")
            if kind == "error":
                raise StepFailed(response.error)
            tokens.append(getattr(response, kind).outputs[0].token_id)
            if on_token is not None:
                on_token(tokens[-1])
            if tokens[-1] in stop_ids or len(tokens) >= a.max_new_tokens:
                break
            window.release()
    except BaseException:
        done.set()
        window.release()
        call.cancel()
        release(stub, seq_id, a.timeout, quiet=True)
        raise
    done.set()
    window.release()  # let the request generator see the end
    call.cancel()  # steps sent past the stop still apply on the server: released below
    release(stub, seq_id, a.timeout, quiet=False)
    return tokens, "eos" if tokens and tokens[-1] in stop_ids else "length"


def release(stub: pb_grpc.ExecutorStub, seq_id: str, timeout: float, quiet: bool) -> None:
    """Release ``seq_id``. Queued behind any call of ours still running on the server
    (calls run in arrival order), so it frees what a timed-out Prefill admitted. With
    ``quiet`` (another error is on its way out) a failure is only reported."""
    try:
        stub.Release(pb.ReleaseRequest(seq_ids=[seq_id]),
                     timeout=max(timeout, RELEASE_TIMEOUT_S))
    except grpc.RpcError as err:
        if not quiet:
            raise
        print(f"model-executor client: could not release {seq_id}: "
              f"{err.code().name}",  # type: ignore[attr-defined]
              file=sys.stderr)


def _token_ids(text: str) -> list[int]:
    return [int(t) for t in text.replace(",", " ").split()]


# -- tokenizer --------------------------------------------------------------------------
def tokenizer_dir(stub: pb_grpc.ExecutorStub, a: argparse.Namespace) -> Path:
    """``--tokenizer``, else the converted directory of the named model the server reports
    in ``Health.model.name`` (from this machine's cache)."""
    if a.tokenizer:
        return Path(a.tokenizer)
    from executor.weights import NAMED_MODELS, cached_model_dir, converted_dir

    health = stub.Health(pb.HealthRequest(), timeout=a.timeout)
    name = health.model.name
    if not name:  # the weights are not loaded yet
        state = pb.ServerState.Name(health.state).removeprefix("SERVER_STATE_")
        raise GenerateError(f"the server is {state.lower()} and does not report its model "
                            "yet: retry once it is ready (or pass --tokenizer DIR)")
    if name in NAMED_MODELS:
        path = cached_model_dir(name)
        if path is None:
            raise GenerateError(
                f"the server serves {name}, whose tokenizer is not in this machine's cache "
                f"({converted_dir(name)}): run `model-executor serve --model {name}` here "
                "once, or pass --tokenizer DIR")
        return path
    raise GenerateError(f"the server serves {name!r}, for which this client knows no "
                        "tokenizer: pass --tokenizer DIR (the model's HF directory) or use "
                        "--tokens")


def load_tokenizer(stub: pb_grpc.ExecutorStub, a: argparse.Namespace) -> tuple[Any, set[int]]:
    """The tokenizer and the token ids that end a sequence."""
    from transformers import AutoTokenizer

    path = tokenizer_dir(stub, a)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise GenerateError(f"cannot load a tokenizer from {path}: {exc}") from exc
    stop_ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    generation = path / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        stop_ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return tokenizer, stop_ids


def encode(tokenizer: Any, prompt: str, chat: bool) -> list[int]:
    """Token ids of ``prompt``; with ``chat``, as one user turn in the model's template."""
    if not chat:
        return list(tokenizer(prompt)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise GenerateError("--chat: this tokenizer has no chat template")
    encoded = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, tokenize=True,
                                            return_dict=True)
    return list(encoded["input_ids"])


class TextStream:
    """Prints generated text as tokens arrive.

    Decodes everything generated so far on each token and prints what is new (a token's
    text can depend on its neighbours). Text ending in U+FFFD waits for the next token:
    that character's bytes are not all there yet. Special tokens (EOS) are not shown.
    """

    def __init__(self, tokenizer: Any, out: TextIO) -> None:
        self._tokenizer = tokenizer
        self._out = out
        self._ids: list[int] = []
        self._shown = ""

    def _text(self) -> str:
        return str(self._tokenizer.decode(self._ids, skip_special_tokens=True,
                                          clean_up_tokenization_spaces=False))

    def _emit(self, text: str) -> None:
        if text.startswith(self._shown):
            self._out.write(text[len(self._shown):])
            self._out.flush()
        self._shown = text

    def push(self, token_id: int) -> None:
        self._ids.append(token_id)
        text = self._text()
        if not text.endswith("\ufffd"):
            self._emit(text)

    def close(self) -> None:
        self._emit(self._text())
        self._out.write("\n")
        self._out.flush()
