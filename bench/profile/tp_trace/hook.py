"""The wrappers ``bench.profile.tp_trace`` installs (see there); ``arm`` installs them once the
executor is imported."""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

#: Seconds between the writer thread's appends to the trace file.
FLUSH_S = 0.5

# (a deque: the traced threads append while the writer pops, each step atomic)
_records: deque[str] = deque()
_path: Path | None = None
_writing = threading.Lock()  # the writer thread and atexit: one appends at a time, in order


def flush() -> None:
    """Append every record so far to the trace file."""
    with _writing:
        lines = []
        while _records:
            lines.append(_records.popleft())
        if lines and _path is not None:
            with _path.open("a") as f:
                f.write("".join(lines))


def _writer() -> None:
    while True:
        time.sleep(FLUSH_S)
        flush()


def _record(tag: str, extra: str = "") -> None:
    _records.append(f"{tag} {time.monotonic_ns()}{extra}\n")


def _step_fields(header: Any) -> str:
    """`` phase seqs`` of a step header, else nothing."""
    sizes = getattr(header, "sizes", None)  # only a StepHeader has sizes
    return "" if sizes is None else f" {header.phase} {sizes.seqs}"


def _wrap(owner: Any, name: str, tag: str,
          detail: Callable[[Sequence[Any], Any], str] | None = None) -> None:
    """``owner.name`` records ``tag0`` when called and ``tag1`` when it returns (with
    ``detail(args, result)`` appended to the second)."""
    fn = getattr(owner, name)
    static = isinstance(owner.__dict__.get(name), staticmethod)

    def traced(*args: Any, **kwargs: Any) -> Any:
        _record(tag + "0")
        result = fn(*args, **kwargs)
        _record(tag + "1", detail(args, result) if detail is not None else "")
        return result

    setattr(owner, name, staticmethod(traced) if static else traced)


def install() -> None:
    from executor.distributed.channel import StepChannel
    from executor.forward import Forward
    from executor.forward_batch import ForwardBatch

    _wrap(StepChannel, "send", "S", lambda args, _: _step_fields(args[1]))
    _wrap(StepChannel, "_receive_local", "R", lambda _, got: _step_fields(got[0]))
    _wrap(ForwardBatch, "from_packed", "P")
    _wrap(Forward, "run", "F")


class _AfterExecutor(importlib.abc.MetaPathFinder):
    """Installs the wrappers right after ``executor.executor`` is executed (the first
    import of it), then leaves ``sys.meta_path``."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "executor.executor":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            install()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def arm(directory: str) -> None:
    """Trace this process into ``directory`` from the executor's import on."""
    global _path
    _path = Path(directory, f"trace-{os.getpid()}.txt")
    # The ranks of a CUDA server may leave by os._exit or SIGKILL (a rank dies with rank
    # 0), skipping atexit: a thread writes the records as they come.
    threading.Thread(target=_writer, name="tp-trace-writer", daemon=True).start()
    atexit.register(flush)
    if "executor.executor" in sys.modules:
        install()
    else:
        sys.meta_path.insert(0, _AfterExecutor())
