"""The report's bar chart: median output tokens/s per engine, one panel per workload."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ENGINE_COLORS = {
    "cbgen": "#1f77b4",
    "cbgen-noshare": "#aec7e8",
    "cbgen-compile": "#17becf",
    "hf-generate": "#ff7f0e",
    "hf-cb": "#2ca02c",
    "vllm": "#9467bd",
}


def plot(report: dict[str, Any], path: Path) -> None:
    """Bar chart of median output tokens/s per engine, one panel per workload, min-max whiskers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, w in report["workloads"].items() if w["engines"]]
    if not names:
        return
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 4.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        wl = report["workloads"][name]
        rows = [r for r in wl["engines"].values() if r.get("output_tok_s")]
        labels = [r["engine"] for r in rows]
        med = [r["output_tok_s"]["median"] for r in rows]
        lo = [m - r["output_tok_s"]["min"] for m, r in zip(med, rows)]
        hi = [r["output_tok_s"]["max"] - m for m, r in zip(med, rows)]
        colors = [ENGINE_COLORS.get(e, "#7f7f7f") for e in labels]
        bars = ax.bar(range(len(rows)), med, yerr=[lo, hi], capsize=4, color=colors)
        for bar, row in zip(bars, rows):
            if "FAIL" in row.get("flags", []):
                bar.set_hatch("xx")
                bar.set_edgecolor("red")
                ax.annotate(
                    "WRONG OUTPUT",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    color="red",
                    fontsize=8,
                    fontweight="bold",
                )
        ax.set_xticks(range(len(rows)), labels, rotation=20, ha="right")
        ax.set_title(f"{name} ({wl['model']})", fontsize=10)
        ax.set_ylabel("output tokens/s (median, min-max)")
        ax.grid(axis="y", alpha=0.3)
    meta = report["meta"]
    fig.suptitle(
        f"cbgen bench: {meta.get('device')}, {meta.get('dtype')}, {meta.get('threads')} threads, "
        f"{meta.get('repeats')} repeats",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["ENGINE_COLORS", "plot"]
