"""Idempotent retries: recent Prefill/Decode/Fork/UpdateWeights responses kept by
``request_id``.

A scheduler whose call timed out cannot tell whether the step ran. It retries with the same
``request_id`` and gets the first call's response; the step never runs twice (AIP-155).

* The key is ``request_id`` alone (empty: not idempotent). Another method or body under a
  used id is INVALID_ARGUMENT (``RequestIdReused``). Only successes are kept: a failed call
  applied nothing (calls are atomic), so its retry simply runs.
* ``RetryGate`` is the one retry-aware run (cache -> in flight -> run -> put) of the unary
  servicer and the Session. Its checks run on the executor thread, in the step's own job,
  so they are ordered with the steps, and a call whose client gave up still stores its
  response. A retry of a Session step still in flight waits for that step's answer.
* Bounded by ``RetryCacheConfig``; Release drops a sequence's entries. A dropped id is still
  remembered (its hash): its retry is ABORTED (``ResponseExpired``), never run twice.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from google.protobuf.message import Message

from executor.errors import FieldViolation, InvalidRequest
from service.config import RetryCacheConfig
from service.convert import CachedResponse, StepResponse, fork_response
from service.errors import ResponseExpired
from service.gen.model_executor.v1 import executor_pb2 as pb
from service.worker import ExecutorLike, ExecutorWorker

T = TypeVar("T")

# Why an entry was dropped (the keys are the evictions metric's reason labels).
_WHY = {"capacity": "evicted: the retry cache was full",
        "bytes": "evicted: the retry cache reached its byte limit",
        "sequence": "evicted: newer calls of the same sequence replaced it",
        "release": "its sequence was released",
        "too_large": "the response was too large to keep"}
_ENTRY_OVERHEAD_BYTES = 256  # dict slots, the key, the entry object


class RequestIdReused(InvalidRequest):
    """A request_id already used by a different call (method or body)."""

    def __init__(self, request_id: str) -> None:
        super().__init__([FieldViolation(
            "request_id", f"{request_id!r} was already used by a different call; a retry must "
            "repeat the original call exactly, and a new call needs a new request_id")])


@dataclass(frozen=True)
class Key:
    request_id: str
    digest: bytes  # of the method and the request without its request_id


def digest(method: str, request: Message) -> bytes:
    body = type(request)()
    body.CopyFrom(request)
    body.ClearField("request_id")  # type: ignore[arg-type]
    h = hashlib.blake2b(method.encode(), digest_size=16)
    h.update(b"\0")
    h.update(body.SerializeToString(deterministic=True))
    return h.digest()


@dataclass
class _Entry:
    digest: bytes
    response: CachedResponse
    seq_ids: tuple[str, ...]
    size: int


class ResponseCache:
    """Responses of calls that succeeded, by ``request_id``. Shared by the event loop (a
    fast path answers a retry without queueing) and the executor thread; one lock guards
    it."""

    def __init__(self, config: RetryCacheConfig,
                 on_evict: Callable[[str], None] | None = None) -> None:
        self.config = config
        self._on_evict = on_evict
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._by_seq: dict[str, list[str]] = {}  # seq_id -> request_ids, oldest first
        self._forgotten: OrderedDict[str, tuple[bytes, str]] = OrderedDict()
        self._bytes = 0

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def key(self, method: str, request: pb.PrefillRequest | pb.DecodeRequest | pb.ForkRequest
            | pb.UpdateWeightsRequest) -> Key | None:
        """The call's key; None when it has no request_id or the cache is off."""
        if not self.enabled or not request.request_id:
            return None
        return Key(request.request_id, digest(method, request))

    def size(self) -> tuple[int, int]:
        """(entries, bytes) kept now."""
        with self._lock:
            return len(self._entries), self._bytes

    def get(self, key: Key) -> CachedResponse | None:
        """The original response of a retry; None for a call not seen (or not succeeded).

        Raises RequestIdReused for a different call under a used id, ResponseExpired for a
        retry whose response was dropped."""
        with self._lock:
            entry = self._entries.get(key.request_id)
            if entry is not None:
                if entry.digest != key.digest:
                    raise RequestIdReused(key.request_id)
                self._entries.move_to_end(key.request_id)
                return entry.response
            forgotten = self._forgotten.get(key.request_id)
        if forgotten is None:
            return None
        if forgotten[0] != key.digest:
            raise RequestIdReused(key.request_id)
        raise ResponseExpired(key.request_id, _WHY[forgotten[1]])

    def get_step(self, key: Key) -> StepResponse | None:
        """``get`` for a Prefill or Decode key (its digest names the method, so it never
        finds another method's response)."""
        response = self.get(key)
        assert not isinstance(response, (pb.ForkResponse, pb.UpdateWeightsResponse))
        return response

    def get_fork(self, key: Key) -> pb.ForkResponse | None:
        """``get`` for a Fork key."""
        response = self.get(key)
        assert response is None or isinstance(response, pb.ForkResponse)
        return response

    def get_update(self, key: Key) -> pb.UpdateWeightsResponse | None:
        """``get`` for an UpdateWeights key."""
        response = self.get(key)
        assert response is None or isinstance(response, pb.UpdateWeightsResponse)
        return response

    def put(self, key: Key, seq_ids: Iterable[str], response: CachedResponse) -> None:
        """Keep the response of a call that succeeded, then enforce the bounds."""
        size = response.ByteSize() + len(key.request_id) + _ENTRY_OVERHEAD_BYTES
        evicted: list[str] = []
        with self._lock:
            if key.request_id in self._entries:  # only after a lost race; keep the first
                return
            if size > self.config.max_bytes:
                self._forget(key.request_id, key.digest, "too_large")
                evicted.append("too_large")
            else:
                entry = _Entry(key.digest, response, tuple(dict.fromkeys(seq_ids)), size)
                self._entries[key.request_id] = entry
                self._bytes += size
                for seq_id in entry.seq_ids:
                    self._by_seq.setdefault(seq_id, []).append(key.request_id)
                evicted = self._enforce(entry.seq_ids)
        self._notify(evicted)

    def drop_sequences(self, seq_ids: Iterable[str]) -> int:
        """Drop every entry of the sequences (they were released); how many."""
        evicted: list[str] = []
        with self._lock:
            for seq_id in seq_ids:
                for request_id in list(self._by_seq.get(seq_id, ())):
                    self._evict(request_id, "release")
                    evicted.append("release")
        self._notify(evicted)
        return len(evicted)

    # -- internals (lock held) -----------------------------------------------------------
    def _enforce(self, seq_ids: tuple[str, ...]) -> list[str]:
        evicted = []
        for seq_id in seq_ids:
            ids = self._by_seq.get(seq_id, [])
            while len(ids) > self.config.per_sequence:
                self._evict(ids[0], "sequence")
                evicted.append("sequence")
        while len(self._entries) > self.config.max_entries:
            self._evict(next(iter(self._entries)), "capacity")
            evicted.append("capacity")
        while self._bytes > self.config.max_bytes:
            self._evict(next(iter(self._entries)), "bytes")
            evicted.append("bytes")
        return evicted

    def _evict(self, request_id: str, reason: str) -> None:
        entry = self._entries.pop(request_id)
        self._bytes -= entry.size
        for seq_id in entry.seq_ids:
            ids = self._by_seq[seq_id]
            ids.remove(request_id)
            if not ids:
                del self._by_seq[seq_id]
        self._forget(request_id, entry.digest, reason)

    def _forget(self, request_id: str, key_digest: bytes, reason: str) -> None:
        self._forgotten[request_id] = (key_digest, reason)
        self._forgotten.move_to_end(request_id)
        while len(self._forgotten) > self.config.max_forgotten:
            self._forgotten.popitem(last=False)

    def _notify(self, reasons: list[str]) -> None:
        if self._on_evict is not None:
            for reason in reasons:
                self._on_evict(reason)


class InflightSteps:
    """Session steps launched with a request_id and not answered yet, by key. A retry that
    arrives meanwhile (a unary call, another stream) waits for the original's response
    instead of running the step a second time; ``None`` means the original did not apply.
    Added on the executor thread at launch, so a retry's own job there sees it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps: dict[Key, concurrent.futures.Future[StepResponse | None]] = {}

    def add(self, key: Key) -> None:
        with self._lock:
            self._steps[key] = concurrent.futures.Future()

    def get(self, key: Key) -> concurrent.futures.Future[StepResponse | None] | None:
        with self._lock:
            return self._steps.get(key)

    def resolve(self, key: Key, response: StepResponse | None) -> None:
        with self._lock:
            future = self._steps.pop(key, None)
        if future is not None:
            future.set_result(response)


@dataclass(frozen=True)
class Replayed:
    """A retry answered with its original's response: nothing ran."""

    response: StepResponse


@dataclass(frozen=True)
class _Waiting:
    """The original is a Session step still in flight: wait for its answer."""

    original: concurrent.futures.Future[StepResponse | None]


class RetryGate:
    """The retry-aware run of a Prefill or Decode, shared by the unary servicer and the
    Session: cache -> in flight -> run -> put.

    ``run`` runs ``job`` on the executor thread unless the call is a retry: a retry of a
    call that succeeded gets its cached response, and a retry of a Session step still in
    flight waits for that step's answer (and runs itself if the original did not apply).
    The caller stores the response of what ran with ``answer`` (the unary job inside the
    job; the Session once the step completes) or, for a held step that failed, ``abandon``.
    """

    def __init__(self, worker: ExecutorWorker, cache: ResponseCache) -> None:
        self.cache = cache
        self._worker = worker
        self._inflight = InflightSteps()

    def cached(self, key: Key | None) -> StepResponse | None:
        """The original response of a retry, looked up on the event loop (a fast path
        that queues nothing); None: the call goes through ``run``."""
        return self.cache.get_step(key) if key is not None else None

    async def run(self, key: Key | None, job: Callable[[ExecutorLike], T], *,
                  deadline: float | None = None, hold: bool = False,
                  check: Callable[[], None] | None = None) -> T | Replayed:
        """``job(ex)`` on the executor thread, or the original's response of a retry.

        ``check`` runs first there and raises to refuse the call (a Session step after a
        failure). With ``hold`` the key stays in flight from the job until ``answer`` or
        ``abandon``, so retries wait for it; if the job raises it is abandoned here."""
        held: list[Key] = []  # the key this call put in flight, if any

        def gated(ex: ExecutorLike) -> T | Replayed | _Waiting:
            if check is not None:
                check()
            if key is not None:  # a retry: answered by its original, never run twice
                if (cached := self.cache.get_step(key)) is not None:
                    return Replayed(cached)
                if (original := self._inflight.get(key)) is not None:
                    return _Waiting(original)
                if hold:
                    self._inflight.add(key)
                    held.append(key)
            return job(ex)

        while True:
            try:
                outcome = (await self._worker.run(gated, deadline)).value
            except BaseException:
                for k in held:  # never launched: a waiting retry must run it itself
                    self._inflight.resolve(k, None)
                raise
            if not isinstance(outcome, _Waiting):
                return outcome
            original = await asyncio.wrap_future(outcome.original)
            if original is not None:  # else the original did not apply: run it here
                return Replayed(original)

    def answer(self, key: Key | None, seq_ids: Iterable[str], response: StepResponse) -> None:
        """Keep the response of a step that succeeded; retries waiting for it get it."""
        if key is not None:
            self.cache.put(key, seq_ids, response)
            self._inflight.resolve(key, response)

    def abandon(self, key: Key | None) -> None:
        """A held step that did not apply: retries waiting for it run themselves."""
        if key is not None:
            self._inflight.resolve(key, None)


def fork_once(ex: ExecutorLike, cache: ResponseCache, key: Key | None, parent: str,
              child: str, prefix: int | None) -> tuple[pb.ForkResponse, bool]:
    """Fork on the executor thread (so ordered with the steps) unless the call's
    ``request_id`` already applied: ``(response, replayed)``."""
    if key is not None and (original := cache.get_fork(key)) is not None:
        return original, True
    response = fork_response(ex.fork(parent, child, prefix))
    if key is not None:
        cache.put(key, [child], response)
    return response, False
