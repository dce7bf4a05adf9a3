"""``MaskWorker``: jobs run in order off the calling thread, the counter follows them, a
failed job releases its gate and is raised once; on CUDA the device waits for the counter
(``wait_for_ticket``) while the host goes on (marker ``gpu`` for that part)."""

from __future__ import annotations

import threading
import time

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


@pytest.mark.gpu
@pytest.mark.parametrize("driver", [True, False], ids=["stream-wait", "polling"])
@pytest.mark.parametrize("words", [4096, 64 * 4096], ids=["16KiB", "1MiB"])
def test_the_device_waits_for_the_ticket_while_the_host_goes_on(
        driver: bool, words: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy from pinned memory queued behind the wait reads what the job wrote after it
    was queued; nothing on the host blocks meanwhile (the sizes of one row's and 64 rows'
    masks)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from executor.kernels import host_wait

    monkeypatch.setattr(host_wait, "_use_driver", driver)
    worker = MaskWorker(torch.device("cuda"))
    worker.gate(0)  # (compiles the polling wait; ticket 0 is done from the start)
    torch.cuda.synchronize()
    host = torch.zeros(words, dtype=torch.int32, pin_memory=True)
    release = threading.Event()

    def job() -> None:
        release.wait(10)
        host.fill_(7)  # written before the counter: the copy below must see it

    ticket = worker.submit(job)
    started = time.perf_counter()
    worker.gate(ticket)  # queued on the stream: returns at once
    out = host.to("cuda", non_blocking=True) + 1
    done = torch.cuda.Event()
    done.record()
    queued = time.perf_counter() - started
    time.sleep(0.2)
    held = not done.query()
    release.set()
    done.synchronize()
    assert queued < 2.0 and held
    assert bool((out == 8).all())
    assert host_wait._use_driver == driver  # (the driver's wait was not refused)
    worker.close()
