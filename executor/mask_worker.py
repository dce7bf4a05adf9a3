"""``MaskWorker``: grammar masks made on a thread of their own, gated on the device.

A step with grammar rows needs each row's mask after its previous token reached the host.
The launching thread does not wait for it: it queues the mask job here, then (on CUDA) a
device wait for the job's ticket (``kernels/host_wait.py``) before the copies and kernels
that read the mask, and goes on launching. The worker runs jobs in order, each waiting for
the tokens it needs while the device runs the step's forward; after a job, done or failed,
it writes the job's ticket to a pinned counter, which releases the device. So a pipelined
Session's grammar work overlaps the forward instead of adding to it. On CPU the launching
thread waits for the job instead (same jobs, same order).

A job never waits for work queued after it, so jobs cannot deadlock: each waits only for
device work queued before its own wait. A failed job leaves its rows' masks as they were
filled (all ones where unwritten) and is raised by ``raise_failure`` at the step's
completion, so the step fails instead of returning unconstrained tokens.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

import numpy as np
import torch


class MaskWorker:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        # The last ticket done (modulo 2**32), read by the device's waits (pinned: mapped
        # for them).
        self.counter = torch.zeros(1, dtype=torch.int32, pin_memory=self.cuda)
        self._counter = self.counter.numpy().view(np.uint32)
        self._jobs: deque[tuple[int, Callable[[], None]]] = deque()
        self._cond = threading.Condition()
        self._issued = 0
        self._done = 0
        self._failure: BaseException | None = None
        self._closed = False
        self._thread: threading.Thread | None = None  # started at the first job

    # -- the launching thread --------------------------------------------------------------
    def submit(self, job: Callable[[], None]) -> int:
        """Queue ``job``; returns its ticket (``gate`` waits for it)."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the grammar mask worker is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="grammar-masks",
                                                daemon=True)
                self._thread.start()
            self._issued += 1
            self._jobs.append((self._issued, job))
            self._cond.notify_all()
            return self._issued

    def gate(self, ticket: int) -> None:
        """What comes next waits for job ``ticket``: on CUDA the current stream (a queued
        device wait; the host goes on), else the calling thread."""
        if self.cuda:
            from executor.kernels.host_wait import wait_for_ticket

            wait_for_ticket(self.counter, ticket)
        else:
            self._wait_done(ticket)

    def drain(self) -> None:
        """Wait until every queued job ran (before the host reads or changes matchers)."""
        self._wait_done(self._issued)

    def raise_failure(self) -> None:
        """Raise (once) the error of a job that failed, if any."""
        with self._cond:
            failure, self._failure = self._failure, None
        if failure is not None:
            raise RuntimeError(f"making grammar masks failed: {failure}") from failure

    def close(self) -> None:
        """Run what is queued, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _wait_done(self, ticket: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._done >= ticket)

    # -- the worker thread -----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._jobs) or self._closed)
                if not self._jobs:
                    return
                ticket, job = self._jobs.popleft()
            try:
                job()
            except BaseException as exc:  # (reported at the step's completion)
                with self._cond:
                    self._failure = self._failure or exc
            finally:
                # The pinned counter first: the device goes on as soon as it is written.
                self._counter[0] = ticket & 0xFFFFFFFF
                with self._cond:
                    self._done = ticket
                    self._cond.notify_all()
