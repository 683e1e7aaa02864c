"""Miss-ratio curves as a PNG: hit rate against slots, one line per policy, the optimum dashed."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .mrc import OPTIMUM
from .replay import ReplayResult


def plot_curves(results: Sequence[ReplayResult], path: str | Path, *, title: str = "",
                total_experts: int | None = None) -> Path:
    """One line per policy label; ``belady`` drawn as the black dashed optimum."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib, which is not installed: "
                         "pip install 'expertcache[plot]'") from None
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    lines: dict[str, list[ReplayResult]] = {}
    for r in results:
        lines.setdefault(r.label or r.policy, []).append(r)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for label, rs in lines.items():
        rs = sorted(rs, key=lambda r: r.slots)
        xs, ys = [r.slots for r in rs], [r.hit_rate for r in rs]
        if rs[0].policy == OPTIMUM and rs[0].admission == "always":
            ax.plot(xs, ys, "k--", marker=".", label=f"{label} (optimum)")
        else:
            ax.plot(xs, ys, marker="o", markersize=3, label=label)
    ax.set_xlabel(f"slots (total{f', of {total_experts} experts' if total_experts else ''})")
    ax.set_ylabel("hit rate")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
