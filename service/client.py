"""``model-executor client``: a small debug client for people without grpcurl.

Each command prints the response as JSON (proto field names) on stdout; an error prints
its status code, message and google.rpc details on stderr and exits 1. ``--tls-ca`` (and
``--tls-cert``/``--tls-key`` for mTLS) connect over TLS; ``--token``, ``--token-file`` or
``$MODEL_EXECUTOR_TOKEN`` send a bearer token with every call.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from service.auth import AUTHORIZATION, read_secret
from service.gen.model_executor.v1 import executor_pb2 as pb
from service.gen.model_executor.v1 import executor_pb2_grpc as pb_grpc
from service.generate import GenerateError, StepFailed, generate
from service.tls import channel_credentials

TOKEN_ENV = "MODEL_EXECUTOR_TOKEN"


def _tokens(text: str) -> list[int]:
    return [int(t) for t in text.replace(",", " ").split()]


def _sampling(args: argparse.Namespace) -> pb.SamplingParams:
    msg = pb.SamplingParams(temperature=args.temperature, top_k=args.top_k, min_p=args.min_p,
                            logprobs=args.logprobs, top_logprobs=args.top_logprobs)
    if args.top_p is not None:
        msg.top_p = args.top_p
    if args.seed is not None:
        msg.seed = args.seed
    return msg


def _prefill(stub: pb_grpc.ExecutorStub, _: grpc.Channel, a: argparse.Namespace) -> Message:
    item = pb.PrefillItem(seq_id=a.seq_id, token_ids=_tokens(a.tokens), sample=not a.no_sample,
                          sampling=_sampling(a))
    return stub.Prefill(pb.PrefillRequest(request_id=a.request_id, items=[item]),
                        timeout=a.timeout)


def _decode(stub: pb_grpc.ExecutorStub, _: grpc.Channel, a: argparse.Namespace) -> Message:
    item = pb.DecodeItem(seq_id=a.seq_id, token_id=a.token, sampling=_sampling(a))
    return stub.Decode(pb.DecodeRequest(request_id=a.request_id, items=[item]),
                       timeout=a.timeout)


def _release(stub: pb_grpc.ExecutorStub, _: grpc.Channel, a: argparse.Namespace) -> Message:
    return stub.Release(pb.ReleaseRequest(request_id=a.request_id, seq_ids=a.seq_ids),
                        timeout=a.timeout)


def _truncate(stub: pb_grpc.ExecutorStub, _: grpc.Channel, a: argparse.Namespace) -> Message:
    return stub.Truncate(pb.TruncateRequest(seq_id=a.seq_id, length=a.length),
                         timeout=a.timeout)


def _fork(stub: pb_grpc.ExecutorStub, _: grpc.Channel, a: argparse.Namespace) -> Message:
    request = pb.ForkRequest(request_id=a.request_id, parent_seq_id=a.parent,
                             child_seq_id=a.child)
    if a.prefix_len is not None:
        request.prefix_len = a.prefix_len
    return stub.Fork(request, timeout=a.timeout)


def _capture(stub: pb_grpc.ExecutorStub, _: grpc.Channel, a: argparse.Namespace) -> Message:
    phases = [f"PHASE_{p.upper()}" for p in a.phase]
    return stub.Capture(pb.CaptureRequest(phases=phases, force=a.force), timeout=a.timeout)


def _update_weights(stub: pb_grpc.ExecutorStub, _: grpc.Channel, a: argparse.Namespace
                    ) -> Message:
    return stub.UpdateWeights(pb.UpdateWeightsRequest(
        request_id=a.request_id, weight_version=a.weight_version, path=a.path),
        timeout=a.timeout)


def _sleep(stub: pb_grpc.ExecutorStub, _: grpc.Channel, a: argparse.Namespace) -> Message:
    return stub.Sleep(pb.SleepRequest(tags=a.tag, discard_weights=a.discard_weights,
                                      drop_sequences=a.drop_sequences), timeout=a.timeout)


def _wake_up(stub: pb_grpc.ExecutorStub, _: grpc.Channel, a: argparse.Namespace) -> Message:
    return stub.WakeUp(pb.WakeUpRequest(tags=a.tag), timeout=a.timeout)


def _health(stub: pb_grpc.ExecutorStub, _: grpc.Channel, a: argparse.Namespace) -> Message:
    return stub.Health(pb.HealthRequest(), timeout=a.timeout)


def _check(_: pb_grpc.ExecutorStub, channel: grpc.Channel, a: argparse.Namespace) -> Message:
    health = health_pb2_grpc.HealthStub(channel)
    return health.Check(health_pb2.HealthCheckRequest(service=a.service), timeout=a.timeout)


def _generate(stub: pb_grpc.ExecutorStub, _: grpc.Channel, a: argparse.Namespace
              ) -> dict[str, Any] | None:
    """One sequence from prompt to stop (``service/generate.py``)."""
    return generate(stub, a, _sampling(a))


def _print(result: Message | dict[str, Any] | None) -> None:
    if result is None:  # the command printed its own output
        return
    if isinstance(result, dict):
        print(json.dumps(result, indent=2))
    else:
        print(json_format.MessageToJson(result, preserving_proto_field_name=True, indent=2))


def describe_error(err: grpc.RpcError) -> dict[str, Any]:
    """A grpc error's code, message and decoded google.rpc details."""
    out: dict[str, Any] = {"code": err.code().name, "message": err.details()}  # type: ignore[attr-defined]
    return _with_details(out, rpc_status.from_call(err))  # type: ignore[arg-type]


def describe_step_error(error: pb.StepError) -> dict[str, Any]:
    """A failed Session step, reported as ``describe_error`` reports the unary call."""
    from google.rpc import status_pb2

    out: dict[str, Any] = {"code": error.code_name, "message": error.message}
    return _with_details(out, status_pb2.Status.FromString(error.status)
                         if error.status else None)


def _with_details(out: dict[str, Any], status: Any) -> dict[str, Any]:
    if status is not None:
        details = []
        for detail in status.details:
            details.append({"type": detail.TypeName(), **json.loads(json_format.MessageToJson(
                _unpack(detail), preserving_proto_field_name=True))})
        out["details"] = details
    return out


def _unpack(detail: Any) -> Message:
    from google.rpc import error_details_pb2

    cls = getattr(error_details_pb2, detail.TypeName().rsplit(".", 1)[-1])
    msg: Message = cls()
    detail.Unpack(msg)
    return msg


class _TokenAuth(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamStreamClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every call, Session streams included (also
    on plaintext channels, which grpc's own call credentials refuse; the server warns about
    that off loopback)."""

    def __init__(self, token: str) -> None:
        self._header = (AUTHORIZATION, f"Bearer {token}")

    def _with_token(self, details: Any) -> Any:
        return details._replace(metadata=[*(details.metadata or ()), self._header])

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_stream_stream(self, continuation: Any, details: Any,
                                request_iterator: Any) -> Any:
        return continuation(self._with_token(details), request_iterator)


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    """A channel to ``args.target`` with the TLS and token options applied."""
    if args.tls_ca is not None or args.tls_cert is not None:
        options = ([("grpc.ssl_target_name_override", args.tls_server_name)]
                   if args.tls_server_name else [])
        creds = channel_credentials(args.tls_ca, args.tls_cert, args.tls_key)
        channel = grpc.secure_channel(args.target, creds, options=options)
    else:
        channel = grpc.insecure_channel(args.target)
    secret = read_secret(args.token_file, dict(os.environ), TOKEN_ENV) \
        if args.token is None else None
    token = args.token if args.token is not None else (secret.value if secret else None)
    return grpc.intercept_channel(channel, _TokenAuth(token)) if token else channel


def run(args: argparse.Namespace) -> int:
    try:
        channel = open_channel(args)
    except ValueError as exc:
        print(f"model-executor client: {exc}", file=sys.stderr)
        return 2
    with channel:
        stub = pb_grpc.ExecutorStub(channel)
        try:
            _print(args.func(stub, channel, args))
        except grpc.RpcError as err:
            print(json.dumps(describe_error(err), indent=2), file=sys.stderr)
            return 1
        except StepFailed as exc:
            print(json.dumps(describe_step_error(exc.error), indent=2), file=sys.stderr)
            return 1
        except GenerateError as exc:
            print(f"model-executor client: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("model-executor client: interrupted", file=sys.stderr)
            return 130
    return 0


def _add_sampling(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (default: greedy)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--logprobs", action="store_true")
    g.add_argument("--top-logprobs", type=int, default=0)


def add_client_parser(subparsers: argparse._SubParsersAction) -> None:
    client = subparsers.add_parser("client", help="call a running server (debugging)")
    client.add_argument("--target", default="127.0.0.1:50051", help="host:port of the server")
    client.add_argument("--timeout", type=float, default=30.0, help="deadline in seconds")
    client.add_argument("--request-id", default="", help="request id to send")
    tls = client.add_argument_group("TLS and tokens")
    tls.add_argument("--tls-ca", type=Path, default=None,
                     help="connect over TLS, trusting this CA (PEM)")
    tls.add_argument("--tls-cert", type=Path, default=None,
                     help="client certificate (PEM) for mTLS; implies TLS")
    tls.add_argument("--tls-key", type=Path, default=None, help="its private key (PEM)")
    tls.add_argument("--tls-server-name", default=None,
                     help="name to check the server certificate against (default: the host)")
    tls.add_argument("--token", default=None,
                     help=f"bearer token (visible to other users in the process list: prefer "
                     f"--token-file or ${TOKEN_ENV})")
    tls.add_argument("--token-file", default=None, help="file holding the bearer token")
    client.set_defaults(run=run)
    cmds = client.add_subparsers(dest="client_command", required=True)

    cmds.add_parser("health", help="Executor/Health: state, model, KV, graphs"
                    ).set_defaults(func=_health)
    check = cmds.add_parser("check", help="grpc.health.v1.Health/Check")
    check.add_argument("--service", default="",
                       help="'' (liveness) or model_executor.v1.Executor (readiness)")
    check.set_defaults(func=_check)

    prefill = cmds.add_parser("prefill", help="prefill one sequence")
    prefill.add_argument("--seq-id", required=True)
    prefill.add_argument("--tokens", required=True, help="token ids, e.g. '1,2,3'")
    prefill.add_argument("--no-sample", action="store_true", help="fill the KV cache only")
    _add_sampling(prefill)
    prefill.set_defaults(func=_prefill)

    decode = cmds.add_parser("decode", help="decode one step of one sequence")
    decode.add_argument("--seq-id", required=True)
    decode.add_argument("--token", type=int, required=True, help="the token to append")
    _add_sampling(decode)
    decode.set_defaults(func=_decode)

    release = cmds.add_parser("release", help="free sequences")
    release.add_argument("seq_ids", nargs="+")
    release.set_defaults(func=_release)

    truncate = cmds.add_parser("truncate", help="keep a sequence's first LENGTH tokens")
    truncate.add_argument("seq_id")
    truncate.add_argument("length", type=int)
    truncate.set_defaults(func=_truncate)

    fork = cmds.add_parser("fork", help="start CHILD sharing PARENT's prefix KV")
    fork.add_argument("parent")
    fork.add_argument("child")
    fork.add_argument("--prefix-len", type=int, default=None,
                      help="parent tokens to share (default: all of them)")
    fork.set_defaults(func=_fork)

    capture = cmds.add_parser("capture", help="capture CUDA graphs")
    capture.add_argument("--phase", action="append", default=[], choices=("decode", "prefill"),
                         help="repeatable; default: both")
    capture.add_argument("--force", action="store_true", help="recapture captured buckets")
    capture.set_defaults(func=_capture)

    update = cmds.add_parser("update-weights", help="replace the weights from a directory on "
                             "the server (docs/weights.md)")
    update.add_argument("--path", required=True, help="a Hugging Face directory on the server")
    update.add_argument("--weight-version", required=True, help="the new version's name")
    update.set_defaults(func=_update_weights)
    for name, func, what in (("sleep", _sleep, "release"), ("wake-up", _wake_up, "take back")):
        cmd = cmds.add_parser(name, help=f"{what} device memory: weights, kv_cache")
        cmd.add_argument("--tag", action="append", default=[],
                         choices=("weights", "kv_cache"), help="repeatable; default: both")
        if name == "sleep":
            cmd.add_argument("--discard-weights", action="store_true",
                             help="drop the weights (an update refills them) instead of "
                             "backing them up to host memory")
            cmd.add_argument("--drop-sequences", action="store_true",
                             help="release live sequences with the KV cache")
        cmd.set_defaults(func=func)

    generate = cmds.add_parser(
        "generate", help="prefill a prompt, decode to a stop, release",
        description="Token mode (--tokens) prints the generated ids as JSON; prompt mode "
        "(--prompt) tokenizes with the served model's tokenizer and prints the text as it "
        "decodes, stopping at the model's end-of-sequence token.")
    prompt = generate.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--tokens", help="prompt token ids, e.g. '1,2,3'")
    prompt.add_argument("--prompt", help="prompt text")
    generate.add_argument("--chat", action="store_true",
                          help="wrap --prompt as a user turn in the model's chat template")
    generate.add_argument("--tokenizer", default=None, metavar="DIR",
                          help="tokenizer directory (default: the named model the server "
                          "reports, from this machine's cache)")
    generate.add_argument("--seq-id", default=None,
                          help="sequence id (default: a new unique one per run)")
    generate.add_argument("--max-new-tokens", type=int, default=None,
                          help="most tokens to generate (default: 16 with --tokens, 256 with "
                          "--prompt)")
    generate.add_argument("--pipeline", type=int, default=3, metavar="N",
                          help="send the decode steps over one Session, N in flight, each "
                          "continuing from the token sampled last on the server (0: one "
                          "unary Decode at a time; default: %(default)s, the server's "
                          "default --session-depth)")
    _add_sampling(generate)
    generate.set_defaults(func=_generate)
