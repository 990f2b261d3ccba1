"""Training curves from the metrics JSONL, as one PNG (matplotlib, Agg: no display needed)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

#: (metric keys on one panel, panel title); panels whose metrics are absent are skipped.
PANELS = (
    (("reward_mean",), "reward (mean over samples)"),
    (("loss", "pg_loss"), "loss"),
    (("kl",), "KL to reference (k3)"),
    (("entropy",), "entropy (nats / sampled token)"),
    (("clip_frac_low", "clip_frac_high", "tis_truncated_frac"), "clip / truncation fractions"),
    (("ratio_mean", "ratio_max", "tis_weight_mean"), "importance ratios"),
    (("mismatch_kl",), "vLLM vs trainer mismatch (k1)"),
    (("grad_norm",), "grad norm (before clipping)"),
    (("lr",), "learning rate"),
    (("tokens_per_s",), "tokens / s"),
)


def read_metrics(path: str | os.PathLike) -> list[dict]:
    rows = []
    p = Path(path)
    if not p.is_file():
        return rows
    for line in p.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue  # a line torn by a crash
    return rows


def plot_metrics(metrics_path: str | os.PathLike, png_path: str | os.PathLike) -> Path:
    """Draw every known metric against the optimizer step; returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    panels = [(keys, title) for keys, title in PANELS if any(k in r for r in rows for k in keys)]
    n = max(len(panels), 1)
    cols = 2
    nrows = math.ceil(n / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(11, 2.6 * nrows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for ax, (keys, title) in zip(axes.flat, panels):
        for k in keys:
            pts = [(r["step"], r[k]) for r in rows if k in r and r[k] is not None and "step" in r]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", markersize=3, label=k)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        if len(keys) > 1:
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"polar train: {Path(metrics_path).parent.name}", fontsize=10)
    fig.tight_layout()
    out = Path(png_path)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
