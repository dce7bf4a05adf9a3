"""py-spy around a served process: ``PySpy`` records which thread holds the GIL in which
functions, ``summarize`` turns a raw record (``--format raw --threads``) into a table per
thread (threads of one pool merged) of inclusive and self shares, and µs per step when the
sampling rate and the steps served are given. Functions are named ``name (file)``."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

_THREAD = re.compile(r"^thread \(\w+\): (?P<name>.*)$")
_LINE = re.compile(r":\d+\)$")


def _function(frame: str) -> str:
    """``fn (path/to/file.py:12)`` -> ``fn (file.py)``."""
    frame = _LINE.sub(")", frame.strip())
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit('/', 1)[-1]}" if where else name


def parse(text: str) -> dict[str, list[tuple[list[str], int]]]:
    """Stacks (outermost first, functions) and their sample counts, by thread name."""
    threads: dict[str, list[tuple[list[str], int]]] = defaultdict(list)
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        m = _THREAD.match(frames[0])
        # pool workers are "ThreadPoolExecutor-0_3": one row per pool
        name = re.sub(r"_\d+$", "_*", m["name"]) if m else "?"
        threads[name].append(([_function(f) for f in frames[1:]], int(count)))
    return threads


def summarize(text: str, top: int = 12, rate: float | None = None,
              steps: int | None = None) -> str:
    threads = parse(text)
    total = sum(n for stacks in threads.values() for _, n in stacks)
    if not total:
        return "no samples\n"

    def per_step(samples: int) -> str:
        return f", {samples / rate / steps * 1e6:.0f} us per step" if rate and steps else ""

    lines = [f"{total} samples in {len(threads)} threads{per_step(total)}", ""]
    for name, stacks in sorted(threads.items(), key=lambda kv: -sum(n for _, n in kv[1])):
        samples = sum(n for _, n in stacks)
        inclusive: Counter[str] = Counter()
        own: Counter[str] = Counter()
        for frames, n in stacks:
            for fn in set(frames):
                inclusive[fn] += n
            if frames:
                own[frames[-1]] += n
        lines += [f"## {name}: {samples} samples ({samples / total:.0%}{per_step(samples)})",
                  "",
                  "| function | inclusive | self |", "|---|---:|---:|"]
        for fn, n in inclusive.most_common(top):
            lines.append(f"| `{fn}` | {n / samples:.0%} | {own[fn] / samples:.0%} |")
        rest = [(fn, n) for fn, n in own.most_common(top) if fn not in
                dict(inclusive.most_common(top))]
        for fn, n in rest[: top // 2]:
            lines.append(f"| `{fn}` | {inclusive[fn] / samples:.0%} | {n / samples:.0%} |")
        lines.append("")
    return "\n".join(lines)


class PySpy:
    """``py-spy record`` attached to a process for the length of a ``with`` block,
    sampling only the thread that holds the GIL (``--gil``): the samples say who keeps
    the one interpreter busy, ``RATE`` of them a second of it."""

    RATE = 2000

    def __init__(self, pid: int, out: Path) -> None:
        self.pid, self.out = pid, out
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> PySpy:
        self.proc = subprocess.Popen(
            ["py-spy", "record", "--pid", str(self.pid), "--rate", str(self.RATE),
             "--format", "raw", "--threads", "--gil", "--nonblocking", "--output",
             str(self.out)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.0)  # attached before the measured steps
        return self

    def __exit__(self, *exc: object) -> None:
        import signal

        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return
        if not self.out.exists():
            print(f"py-spy wrote nothing: {err.decode(errors='replace')[-400:]}",
                  file=sys.stderr)
