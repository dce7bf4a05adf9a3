"""``python -m bench.profile.tp_trace DIR``: the report of the traces in DIR
(``bench.profile.tp_trace``)."""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Step:
    """One step on one rank, monotonic ns: rank 0's send start and end, another rank's
    receipt and unpacking; each rank's forward call and return."""

    phase: str = ""
    seqs: int = 0
    send: int = 0
    sent: int = 0
    received: int = 0
    unpacked: int = 0
    call: int = 0
    returned: int = 0


@dataclass
class Rank:
    pid: str
    leads: bool
    steps: list[Step] = field(default_factory=list)
    followers: list[Rank] = field(default_factory=list)


def read(path: Path) -> Rank | None:
    """A process's steps; None for one that neither sent nor received a step (a TP = 1
    server, or a process that did not serve)."""
    steps: list[Step] = []
    leads = follows = False
    open_step: Step | None = None
    send_start = 0
    for line in path.read_text().splitlines():
        tag, ns, *rest = line.split()
        t = int(ns)
        if tag == "S0":
            send_start = t
        elif tag == "S1" and rest:
            leads = True
            open_step = Step(rest[0], int(rest[1]), send=send_start, sent=t)
            steps.append(open_step)
        elif tag == "R1" and rest:
            follows = True
            open_step = Step(rest[0], int(rest[1]), received=t)
            steps.append(open_step)
        elif tag in ("S1", "R1"):
            open_step = None  # not a step: what follows is not its forward
        elif open_step is not None:
            if tag == "P1" and not open_step.unpacked:
                open_step.unpacked = t
            elif tag == "F0" and not open_step.call:
                open_step.call = t
            elif tag == "F1" and not open_step.returned:
                open_step.returned = t
    if not (leads or follows):
        return None
    return Rank(path.stem.removeprefix("trace-"), leads, steps)


def group(ranks: list[Rank]) -> list[Rank]:
    """Each rank 0 with its other ranks: a rank belongs to the last rank 0 whose first
    send came before its first receipt (a bench runs its servers one after another)."""
    leaders = sorted((r for r in ranks if r.leads and r.steps), key=lambda r: r.steps[0].send)
    for other in (r for r in ranks if not r.leads and r.steps):
        before = [r for r in leaders if r.steps[0].send <= other.steps[0].received]
        if before:
            before[-1].followers.append(other)
    return [r for r in leaders if r.followers]


#: Report columns: name, and the moment of a step (µs after rank 0's send start).
COLUMNS = ("rank 0 sent", "rank 0 forward call", "rank 0 forward return",
           "others received", "others unpacked", "others forward call",
           "others forward return", "lag")


def rows(leader: Rank) -> dict[tuple[str, int], list[list[float]]]:
    """Per (phase, sequences): per step, ``COLUMNS`` in µs (the other ranks' latest)."""
    out: dict[tuple[str, int], list[list[float]]] = {}
    for k, step in enumerate(leader.steps):
        others = [f.steps[k] for f in leader.followers if k < len(f.steps)]
        if len(others) != len(leader.followers) or not step.returned or any(
                (o.phase, o.seqs) != (step.phase, step.seqs) or not o.returned
                for o in others):
            continue  # a step some rank did not trace whole (the server stopped)

        start = step.send
        latest = [(max(getattr(o, name) for o in others) - start) / 1e3
                  for name in ("received", "unpacked", "call", "returned")]
        own = [(t - start) / 1e3 for t in (step.sent, step.call, step.returned)]
        out.setdefault((step.phase, step.seqs), []).append(
            [*own, *latest, latest[-1] - own[-1]])
    return out


def report(directory: Path) -> str:
    ranks = [r for p in sorted(directory.glob("trace-*.txt")) if (r := read(p))]
    lines = [f"# Tensor-parallel step path ({directory})", "",
             "Medians per phase and batch size, µs after rank 0 began sending the step; "
             "\"others\": the latest other rank; lag: the latest other rank's forward "
             "return after rank 0's.", ""]
    for leader in group(ranks):
        pids = ", ".join(f.pid for f in leader.followers)
        lines += [f"## rank 0 pid {leader.pid} (other ranks: {pids})", "",
                  "| phase | batch | steps | " + " | ".join(COLUMNS) + " |",
                  "|---|---:|---:|" + "---:|" * len(COLUMNS)]
        for (phase, seqs), got in sorted(rows(leader).items()):
            medians = [statistics.median(col) for col in zip(*got, strict=True)]
            lines.append(f"| {phase} | {seqs} | {len(got)} | "
                         + " | ".join(f"{m:.1f}" for m in medians) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("directory", type=Path)
    a = ap.parse_args(argv)
    print(report(a.directory))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
