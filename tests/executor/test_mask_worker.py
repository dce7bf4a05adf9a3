"""``MaskWorker``: jobs run in order off the calling thread, the counter follows them, a
failed job releases its gate and is raised once. (The device side: ``test_late_masks.py``.)"""

from __future__ import annotations

import threading

import pytest
import torch

from executor.mask_worker import MaskWorker


def test_jobs_run_in_order_on_their_thread_and_gate_waits() -> None:
    worker = MaskWorker(torch.device("cpu"))
    order: list[int] = []
    names: set[str] = set()
    release = threading.Event()

    def job(k: int) -> None:
        if k == 0:
            release.wait(5)
        names.add(threading.current_thread().name)
        order.append(k)

    tickets = [worker.submit(lambda k=k: job(k)) for k in range(5)]
    assert tickets == [1, 2, 3, 4, 5]
    assert order == []  # the first job holds the queue
    release.set()
    worker.gate(tickets[2])  # on CPU: this thread waits for job 3
    assert order[:3] == [0, 1, 2]
    worker.drain()
    assert order == [0, 1, 2, 3, 4] and names == {"grammar-masks"}
    assert int(worker.counter[0]) == 5
    worker.close()
    with pytest.raises(RuntimeError, match="closed"):
        worker.submit(lambda: None)


def test_a_failed_job_releases_its_gate_and_is_raised_once() -> None:
    worker = MaskWorker(torch.device("cpu"))
    ran: list[int] = []

    def boom() -> None:
        raise ValueError("no mask")

    worker.gate(worker.submit(boom))  # returns: the failure still moves the counter
    worker.gate(worker.submit(lambda: ran.append(1)))
    assert ran == [1]
    with pytest.raises(RuntimeError, match="no mask"):
        worker.raise_failure()
    worker.raise_failure()  # (once)
    worker.close()
