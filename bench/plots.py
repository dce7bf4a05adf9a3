"""PNG plots of a benchmark result (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write_plots(result: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    rows = result.get("decode_table", [])
    if rows:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for ctx in sorted({r["context"] for r in rows}):
            for mode in dict.fromkeys(r["mode"] for r in rows):
                sel = [r for r in rows if r["context"] == ctx and r["mode"] == mode]
                ax.plot([r["batch"] for r in sel], [r["step_ms_median"] for r in sel],
                        "o--" if mode == "eager" else "o-", label=f"{mode}, ctx {ctx}")
            sel = [r for r in rows if r["context"] == ctx and r["mode"] == rows[0]["mode"]]
            ax.plot([r["batch"] for r in sel], [r["floor_ms"] for r in sel], ":", color="gray",
                    label=f"floor, ctx {ctx}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_ylabel("ms / decode step")
        ax.set_title(f"Decode, Llama-3.2-1B shape — {result['environment']['device']}")
        ax.legend(fontsize=8)
        ax.grid(True, alpha=0.3)
        path = out / "decode.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    prefill = result.get("prefill_table", [])
    if prefill:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for mode in sorted({r["mode"] for r in prefill}):
            for seqs in sorted({r["sequences"] for r in prefill}):
                sel = [r for r in prefill if r["mode"] == mode and r["sequences"] == seqs]
                if sel:
                    ax.plot([r["tokens"] for r in sel], [r["ms_median"] for r in sel], "o-",
                            label=f"{mode}, {seqs} seq")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prefill tokens")
        ax.set_ylabel("ms / prefill call")
        ax.set_title(f"Prefill, Llama-3.2-1B shape — {result['environment']['device']}")
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
        path = out / "prefill.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
