"""Coverage curves and a share heatmap for ``expertcache imatrix --plot`` (matplotlib Agg)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .counts import layer_shares


def save_plot(counts: np.ndarray, plan: list[tuple[int, int]], path: str | Path, title: str = "") -> Path:
    """Left: cumulative share vs experts kept, one curve per layer. Right: share per (layer, expert)
    with the plan's experts marked."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    shares = layer_shares(counts)                      # [L, E]
    L, E = shares.shape
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5), constrained_layout=True)
    colors = plt.cm.viridis(np.linspace(0, 1, L))
    ranks = np.arange(1, E + 1)
    for layer in range(L):
        left.plot(ranks, np.cumsum(np.sort(shares[layer])[::-1]), color=colors[layer], lw=0.8)
    left.plot(ranks, ranks / E, "k--", lw=1, label="uniform routing")
    left.set(xlabel="experts kept (hottest first)", ylabel="share of the layer's routed tokens",
             title="coverage per layer (dark = first layer)", xlim=(1, E), ylim=(0, 1.01))
    left.legend(loc="lower right")
    image = right.imshow(shares, aspect="auto", cmap="magma", interpolation="nearest")
    if plan:
        layers, experts = zip(*plan)
        right.scatter(experts, layers, s=10, facecolors="none", edgecolors="cyan", linewidths=0.6,
                      marker="s", label=f"plan ({len(plan)} experts)")
        right.legend(loc="upper right", fontsize=8)
    right.set(xlabel="expert", ylabel="MoE layer", title="share of each layer's tokens")
    fig.colorbar(image, ax=right, shrink=0.8)
    if title:
        fig.suptitle(title)
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
