"""Where a process's threads spend their time, from ``py-spy record --format raw --threads``.

``python -m bench.pyspy_summary FILE [--top N] [--rate HZ --steps N]`` prints, per thread
(threads with the same name are merged: a pool's workers), its share of the samples and
the functions it spends them in: inclusive (the function is on the stack) and self (it is
the innermost frame).
Functions are named ``name (file)`` without line numbers, so one function is one row. Idle
threads (blocked in the kernel) are not sampled by py-spy unless ``--idle`` was given, so
a thread's samples are roughly its CPU time; recorded with ``--gil``, only the thread
holding the GIL is sampled, so the samples are the interpreter's busy time. With the
sampling ``rate`` and the ``steps`` served while sampling, each thread's samples are
also given as µs per step.
"""

from __future__ import annotations

import argparse
import re
import sys
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", type=Path)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--rate", type=float, default=None, help="samples per second")
    ap.add_argument("--steps", type=int, default=None, help="steps served while sampling")
    a = ap.parse_args(argv)
    print(summarize(a.file.read_text(), a.top, a.rate, a.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
