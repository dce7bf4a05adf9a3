"""The figures the reliability suite reports: calls made, errors by code, invariant checks
passed, peak RSS, Health latency under load, drain timings. Tests add to one ``Figures``
for the session; ``conftest.py`` prints it and writes it as JSON to
``$MODEL_EXECUTOR_RELIABILITY_REPORT`` when set."""

from __future__ import annotations

import json
import resource
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.system.reliability.budget import BUDGET


def rss_bytes() -> int:
    """Resident set size of this process now (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@dataclass
class Figures:
    started: float = field(default_factory=time.monotonic)
    calls: Counter[str] = field(default_factory=Counter)  # method -> calls handled
    codes: Counter[str] = field(default_factory=Counter)  # status code -> calls
    invariant_checks: int = 0
    servers: int = 0
    notes: dict[str, Any] = field(default_factory=dict)  # test-specific figures

    def add_handled(self, method: str, code: str, n: int = 1) -> None:
        self.calls[method] += n
        self.codes[code] += n

    def add_scrape(self, metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> None:
        """Count a server's ``grpc_server_handled_total`` (every call it answered)."""
        self.servers += 1
        for (name, labels), value in metrics.items():
            if name == "grpc_server_handled_total" and value:
                lab = dict(labels)
                self.add_handled(f"{lab['grpc_service'].rsplit('.', 1)[-1]}/"
                                 f"{lab['grpc_method']}", lab["grpc_code"], int(value))

    def summary(self) -> dict[str, Any]:
        errors = {c: n for c, n in sorted(self.codes.items()) if c != "OK"}
        return {
            "budget": BUDGET.name,
            "wall_seconds": round(time.monotonic() - self.started, 1),
            "servers": self.servers,
            "calls": sum(self.calls.values()),
            "calls_by_method": dict(sorted(self.calls.items())),
            "ok": self.codes.get("OK", 0),
            "errors_by_code": errors,
            "invariant_checks_passed": self.invariant_checks,
            "peak_rss_mib": round(peak_rss_bytes() / 2**20, 1),
            **self.notes,
        }

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.summary(), indent=2) + "\n")
