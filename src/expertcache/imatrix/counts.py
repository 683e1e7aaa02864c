"""Per-layer expert counts: how many routed tokens each (layer, expert) received.

Every source (an imatrix GGUF, a routing trace, a popularity JSON, a ``.npy``)
ends up as one ``ExpertCounts``: an int64 array ``[L, E]`` plus where it came
from. Row ``l`` is the l-th MoE layer (the same index the trace format and the
cache keys use), not necessarily GGUF block ``l``: ``meta["blocks"]`` maps rows
back to block numbers when the source has them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, eq=False)  # arrays do not compare to one bool
class ExpertCounts:
    counts: np.ndarray          # int64 [L, E]: routed tokens per (layer, expert)
    source: str = ""            # file it came from (for messages)
    kind: str = "array"         # imatrix | trace | popularity | npy | json | array
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "counts", as_count_array(self.counts, self.source or "counts"))

    @property
    def num_layers(self) -> int:
        return self.counts.shape[0]

    @property
    def num_experts(self) -> int:
        return self.counts.shape[1]

    def shares(self) -> np.ndarray:
        """float64 [L, E]: each expert's share of its layer's routed tokens (0 for empty layers)."""
        return layer_shares(self.counts)


def as_count_array(values: object, where: str) -> np.ndarray:
    """Validate a 2-D table of non-negative whole counts; int64 [L, E]."""
    if isinstance(values, ExpertCounts):
        return values.counts
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: expert counts must be numbers in a [layers, experts] table") from None
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
        raise ValueError(f"{where}: expert counts must be a 2-D [layers, experts] table, got shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{where}: expert counts contain NaN or infinity")
    if (arr < 0).any():
        raise ValueError(f"{where}: expert counts must not be negative (min {arr.min():g})")
    if (arr != np.round(arr)).any():
        raise ValueError(f"{where}: expert counts must be whole numbers of tokens")
    return arr.astype(np.int64)


def layer_shares(counts: np.ndarray) -> np.ndarray:
    totals = counts.sum(axis=1, keepdims=True).astype(np.float64)
    return np.divide(counts, totals, out=np.zeros(counts.shape, dtype=np.float64), where=totals > 0)
