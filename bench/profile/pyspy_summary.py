"""Where a process's threads spend their time, from ``py-spy record --format raw --threads``.

``python -m bench.profile.pyspy_summary FILE [--top N] [--rate HZ --steps N]`` prints, per
thread (threads with the same name are merged: a pool's workers), its share of the samples
and the functions it spends them in: inclusive (the function is on the stack) and self (it
is the innermost frame). Idle threads (blocked in the kernel) are not sampled by py-spy
unless ``--idle`` was given, so a thread's samples are roughly its CPU time; recorded with
``--gil``, only the thread holding the GIL is sampled, so the samples are the
interpreter's busy time. With the sampling ``rate`` and the ``steps`` served while
sampling, each thread's samples are also given as µs per step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.common.pyspy import summarize


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
