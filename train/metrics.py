"""Training metrics: a CSV row per logged step, a PNG of the curves, peak device memory."""

from __future__ import annotations

import csv
from pathlib import Path

import jax
import numpy as np

SCALARS = ("loss", "backbone_ce", "backbone_l1", "refinement", "alignment", "coverage",
           "accept_len_estimate", "accept_len_blocks", "refined_accuracy", "gate_mean",
           "grad_norm", "lr", "tokens_per_s", "mfu")


class MetricsLog:
    """CSV of every logged step (and a PNG of the curves); process 0 only."""

    def __init__(self, path: Path, block_size: int, enabled: bool):
        self.path, self.enabled = path, enabled
        self.columns = ["step", *SCALARS] + [f"slot_acc_{k}" for k in range(1, block_size)]

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        new = not self.path.is_file()
        with open(self.path, "a", newline="") as f:
            writer = csv.DictWriter(f, self.columns, extrasaction="ignore")
            if new:
                writer.writeheader()
            writer.writerow(row)

    def plot(self, png: Path) -> None:
        if not self.enabled or not self.path.is_file():
            return
        with open(self.path) as f:
            rows = list(csv.DictReader(f))
        plot_rows(rows, png)


def plot_rows(rows: list[dict], png: Path, boundaries: tuple = (), title: str = "") -> None:
    """Loss, acceptance and accuracy against step; a dotted line where each of
    `boundaries` (steps) starts a new link of a chain."""
    if not rows:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [int(r["step"]) for r in rows]
    panels = [("loss", ["loss", "backbone_ce", "backbone_l1", "refinement", "alignment"]),
              ("acceptance length", ["accept_len_estimate", "accept_len_blocks"]),
              ("accuracy", ["coverage", "refined_accuracy", "slot_acc_1", "slot_acc_4",
                            "slot_acc_8"])]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (name, keys) in zip(axes, panels):
        for key in keys:
            values = [float(r[key]) if r.get(key) not in (None, "") else np.nan for r in rows]
            if not np.all(np.isnan(values)):
                ax.plot(steps, values, label=key)
        for b in boundaries:
            ax.axvline(b, color="grey", linestyle=":", linewidth=1)
        ax.set_title(name)
        ax.set_xlabel("step")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def peak_device_memory() -> int | None:
    """Largest peak allocation over this process's devices (None where the backend keeps no
    statistics, e.g. CPU)."""
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
    peaks = [p for p in peaks if p is not None]
    return max(peaks) if peaks else None
