"""Plotting an evaluation: each cache's per-layer attention error."""

from __future__ import annotations

import pathlib

from .results import EvaluationResult


def plot_layer_errors(result: EvaluationResult, path) -> None:
    """A PNG of every cache's per-layer attention-output error (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    for cache in result.caches:
        ax.plot(range(len(cache.layer_errors)), cache.layer_errors, marker="o", markersize=3, label=cache.label)
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("relative error of the attention output")
    ax.set_title(f"{pathlib.Path(result.setup.get('model', 'model')).name}: {result.windows} x {result.seq_len} "
                 f"tokens, {result.setup.get('dtype', '')}, {result.setup.get('device', '')}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)
