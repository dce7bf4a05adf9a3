"""Interceptors wrap a method's handler once and reuse it while the inner handler is the
same object; a per-call handler (an auth refusal) is wrapped for that call only."""

from __future__ import annotations

from typing import Any

import grpc

from service.interceptors import _HandlerCache


async def _behavior(request: Any, context: Any) -> Any:
    return request


def _handler() -> grpc.RpcMethodHandler:
    return grpc.unary_unary_rpc_method_handler(_behavior)


def test_wraps_once_per_method_and_inner_handler() -> None:
    wraps: list[grpc.RpcMethodHandler] = []

    def wrap(method: str, inner: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        wraps.append(inner)
        return _handler()

    cache = _HandlerCache(wrap)

    decode, health = _handler(), _handler()
    first = cache.get("/x.S/Decode", decode)
    assert cache.get("/x.S/Decode", decode) is first
    assert cache.get("/x.S/Health", health) is not first
    assert wraps == [decode, health]

    refusal = _handler()  # built per call: wrapped, not cached, the cached one kept
    once = cache.get("/x.S/Decode", refusal)
    assert once is not first and wraps[-1] is refusal
    assert cache.get("/x.S/Decode", decode) is first
    assert len(wraps) == 3
