"""PNG plots of a benchmark result (matplotlib, headless)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any


def write_plots(result: dict[str, Any], out: Path) -> list[Path]:
    from bench.common.shapes import title

    device = result["environment"]["device"]
    shape = title(result.get("shape", "llama-3.2-1b"))
    written = []
    rows = result.get("decode_table", [])
    if rows:
        def decode_lines(ax: Any) -> None:
            color = _colors(r["mode"] for r in rows)
            for i, ctx in enumerate(sorted({r["context"] for r in rows})):
                for mode in dict.fromkeys(r["mode"] for r in rows):
                    sel = [r for r in rows if r["context"] == ctx and r["mode"] == mode]
                    ax.plot([r["batch"] for r in sel], [r["step_ms_median"] for r in sel],
                            _STYLES[i % len(_STYLES)], color=color[mode],
                            label=f"{mode}, ctx {ctx}")
                sel = [r for r in rows if r["context"] == ctx and r["mode"] == rows[0]["mode"]]
                ax.plot([r["batch"] for r in sel], [r["floor_ms"] for r in sel], ":",
                        color="gray", label=f"floor, ctx {ctx}")

        written.append(_plot(out / "decode.png", decode_lines, "batch size", "ms / decode step",
                             f"Decode, {shape} — {device}"))
    prefill = result.get("prefill_table", [])
    if prefill:
        def prefill_lines(ax: Any) -> None:
            color = _colors(r["mode"] for r in prefill)
            for mode in sorted({r["mode"] for r in prefill}):
                for i, seqs in enumerate(sorted({r["sequences"] for r in prefill})):
                    sel = [r for r in prefill if r["mode"] == mode and r["sequences"] == seqs]
                    if sel:
                        ax.plot([r["tokens"] for r in sel], [r["ms_median"] for r in sel],
                                _STYLES[i % len(_STYLES)], color=color[mode],
                                label=f"{mode}, {seqs} seq")

        written.append(_plot(out / "prefill.png", prefill_lines, "prefill tokens",
                             "ms / prefill call", f"Prefill, {shape} — {device}"))
    return written


# One color per mode; the line style tells the second variable (context, sequences) apart.
_STYLES = ("o-", "s--", "^:")


def _colors(modes: Iterable[str]) -> dict[str, Any]:
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    return {m: cmap(i % 10) for i, m in enumerate(sorted(set(modes)))}


def _plot(path: Path, draw: Callable[[Any], None], xlabel: str, ylabel: str, title: str
          ) -> Path:
    """One log-log figure: ``draw`` adds the lines, this adds axes, legend, file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    draw(ax)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
