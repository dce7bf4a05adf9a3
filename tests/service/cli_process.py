"""The ``model-executor`` CLI as the user runs it: ``serve`` in a subprocess with its JSON log
lines collected, and the client subcommands' JSON error report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PROMPT_TOKENS = 3000  # a few hundred ms of prefill each on CPU


class Process:
    """``model-executor serve`` in a subprocess, its JSON log lines collected."""

    def __init__(self, *flags: str) -> None:
        cmd = [sys.executable, "-m", "service.cli", "serve", "--port", "0", "--metrics-port",
               "0", "--kv-tokens", "16384", "--max-sequences", "8", "--max-context", "4096",
               "--max-prefill-tokens", "4096", "--device", "cpu", *flags]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.events: list[dict[str, Any]] = []
        self.other: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.events.append(json.loads(line))
            except json.JSONDecodeError:
                self.other.append(line)

    def wait_event(self, predicate: Callable[[dict[str, Any]], bool],
                   timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for event in list(self.events):
                if predicate(event):
                    return event
            assert self.proc.poll() is None, f"server exited: {self.events} {self.other}"
            time.sleep(0.02)
        raise AssertionError(f"no such log event; got {self.events} {self.other}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self._reader.join(timeout=5)


def client_error(text: str) -> dict:  # type: ignore[type-arg]
    """The client's JSON error report, among the in-process server's log lines."""
    lines = text.splitlines()
    start = max(i for i, line in enumerate(lines) if line == "{")
    end = next(i for i in range(start, len(lines)) if lines[i] == "}")
    return json.loads("\n".join(lines[start:end + 1]))  # type: ignore[no-any-return]
