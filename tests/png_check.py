"""Decode a PNG a command drew and check that it shows something: its size, and pixels of
the colours that stand for the things the plot is about (a signature alone proves only
that a file was written)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def pixels(path: str | Path, size: tuple[int, int]) -> np.ndarray:
    """RGB floats ``[H, W, 3]`` of the PNG at ``path``, asserted to be ``size`` (width, height)
    and not blank (a plot with axes only inks well under 1% of its pixels in colour)."""
    import matplotlib.image as mpimg

    assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    rgb = mpimg.imread(path)[..., :3]
    assert (rgb.shape[1], rgb.shape[0]) == size, f"{path}: {rgb.shape[1]}x{rgb.shape[0]}, not {size}"
    assert (rgb < 0.95).any(-1).mean() > 0.01, f"{path} is nearly blank"
    return rgb


def width_of(rgb: np.ndarray, colour: str, tol: float = 0.08) -> float:
    """Share of the image's columns holding a pixel of a matplotlib colour (e.g. 'tab:red'):
    a line across the axes spans most of it (a dotted one under another line 20% or more),
    its legend sample 3-4%."""
    from matplotlib.colors import to_rgb

    return float((np.abs(rgb - np.array(to_rgb(colour))).max(-1) < tol).any(0).mean())
