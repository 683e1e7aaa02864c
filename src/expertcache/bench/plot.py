"""Steady-state tok/s (MoE part) against slots: one line per cache policy and for belady,
flat lines for the baselines (their speed does not depend on the slot count)."""

from __future__ import annotations

from pathlib import Path

from .strategies import OPTIMUM

_BASELINE_STYLE = {"resident": ("tab:green", ":"), "copy-every-pass": ("tab:red", "--"),
                   "cpu": ("tab:gray", "-.")}


def plot_tok_s(rows: list[dict], path: str | Path, *, title: str = "") -> Path:
    import matplotlib
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    ran = [r for r in rows if r.get("tok_s")]
    lines: dict[str, list[dict]] = {}
    for r in ran:
        if r["strategy"] in ("cache", OPTIMUM):
            lines.setdefault(r["policy"], []).append(r)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for label, rs in lines.items():
        rs = sorted(rs, key=lambda r: r["slots"])
        xs, ys = [r["slots"] for r in rs], [r["tok_s"] for r in rs]
        if label == OPTIMUM:
            ax.plot(xs, ys, "k--", marker=".", label="belady (offline optimum)")
        else:
            ax.plot(xs, ys, marker="o", markersize=4, label=f"cache {label}")
    for r in ran:
        if r["strategy"] in _BASELINE_STYLE:
            color, style = _BASELINE_STYLE[r["strategy"]]
            ax.axhline(r["tok_s"], color=color, linestyle=style, label=r["strategy"])
    ax.set_xlabel("slots (experts held in the pool, all layers)")
    ax.set_ylabel("steady-state tok/s (MoE part)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def title(doc: dict) -> str:
    """The plot's title from a bench document: model, size, tokens, device and CPU."""
    return (f"{doc['model']} x{doc['scale']:g}, {doc['layers']} layers, {doc['tokens']} tokens, "
            f"{doc['device']} ({doc['machine']['cpu'][:40]})")
