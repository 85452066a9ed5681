"""The benchmark figure: median time (bars: p10-p90) vs density, or vs workers in a worker-count sweep.

Log-log vs density because densities span decades and a sparse allreduce should scale with them; in a
sweep, one panel per density shows how each algorithm scales with the number of workers.
"""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the headless backend)

from sparcoll.bench.report import label, title  # noqa: E402


def _lines(ax, records: list[dict], x: str) -> None:
    for name in dict.fromkeys(label(r) for r in records):
        points = sorted((r for r in records if label(r) == name), key=lambda r: r[x])
        medians = [r["median_s"] for r in points]
        spread = [[r["median_s"] - r["p10_s"] for r in points], [r["p90_s"] - r["median_s"] for r in points]]
        ax.errorbar([r[x] for r in points], medians, yerr=spread, marker="o", capsize=3, label=name)
    ax.set_yscale("log")
    ax.set_ylabel("time per allreduce (s), median; bars p10-p90")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")


def plot(records: list[dict], path: str) -> None:
    """Write the figure of `records` to `path`, in the format its extension names."""
    workers = sorted({r["workers"] for r in records})
    if len(workers) == 1:
        fig, ax = plt.subplots(figsize=(7, 5))
        _lines(ax, records, "density")
        ax.set_xscale("log")
        ax.set_xlabel("block density")
    else:
        densities = sorted({r["density"] for r in records})
        fig, axes = plt.subplots(1, len(densities), figsize=(5 * len(densities), 4.5), squeeze=False)
        for ax, density in zip(axes[0], densities):
            _lines(ax, [r for r in records if r["density"] == density], "workers")
            ax.set_xticks(workers)
            ax.set_xlabel("workers")
            ax.set_title(f"density {density:g}")
    fig.suptitle(title(records), fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
