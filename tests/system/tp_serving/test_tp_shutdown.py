"""SIGTERM to a tensor-parallel server whose group teardown blocks (CPU, gloo): the
teardown is bounded, so the server still exits 0 and takes its ranks with it.

The block is injected into every process of the test server (rank 0 and the rank it
spawns) through a ``sitecustomize`` on their ``PYTHONPATH`` that replaces
``torch.distributed.destroy_process_group`` with a wait that never ends: what a
communicator stuck on a peer does on GPUs.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from executor.distributed.bootstrap import TEARDOWN_TIMEOUT_S
from service.parallel import EXIT_GRACE_S
from tests.helpers.serving import ROOT, ServeProcess, alive

GRACE_S = 1.0
BLOCK = '''
import os
if os.environ.get("MODEL_EXECUTOR_TEST_BLOCK_TEARDOWN") == "1":
    import threading
    import torch.distributed as dist

    def _blocked(group=None):
        threading.Event().wait()

    dist.destroy_process_group = _blocked
'''


def test_sigterm_exits_zero_although_the_group_teardown_blocks(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(BLOCK)
    env = {"PYTHONPATH": os.pathsep.join((str(tmp_path), str(ROOT))),
           "MODEL_EXECUTOR_TEST_BLOCK_TEARDOWN": "1"}
    server = ServeProcess(["--model", "tiny", "--kv-tokens", "160", "--max-context", "128",
                           "--max-sequences", "8", "--tensor-parallel-size", "2",
                           "--drain-delay", "0", "--grace-period", str(GRACE_S)], env=env)
    try:
        server.wait_ready()
        rank1 = server.rank_pids[1]
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        # drain delay + grace + the teardown's bound + a few seconds
        assert server.proc.wait(GRACE_S + TEARDOWN_TIMEOUT_S + EXIT_GRACE_S + 15) == 0
        assert time.monotonic() - started < GRACE_S + TEARDOWN_TIMEOUT_S + 15
        server.wait_for("exit_forced", timeout=5)
        deadline = time.monotonic() + 10
        while alive(rank1) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(rank1), "rank 1 outlived rank 0"
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
        for pid in server.rank_pids.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
