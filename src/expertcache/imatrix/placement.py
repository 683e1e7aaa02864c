"""What the counts say about each layer, and which experts to place on the GPU.

Placement value of (layer, expert): its share of the layer's routed tokens.
Every token passes every MoE layer once, so a share ``p`` means that keeping
the expert resident saves ``top_k * p`` expected loads per token at that layer,
wherever the layer sits. Shares (not raw counts) make layers comparable when
their totals differ (merged files, missing blocks). With a budget of N slots
the N highest shares overall maximise the expected static hits, so the greedy
pick by marginal coverage is exact here: concentrated layers get many slots,
flat layers few or none.
"""

from __future__ import annotations

import numpy as np

from .counts import ExpertCounts, as_count_array, layer_shares

HOT = 8  # experts listed per layer in a report


def coverage(counts: ExpertCounts | np.ndarray, hot: int = HOT) -> list[dict]:
    """Per layer: routed selections, hottest share, experts needed for 50% / 90%, hot list."""
    table = as_count_array(counts, "counts")
    shares = layer_shares(table)
    out = []
    for layer, row in enumerate(shares):
        order = np.argsort(-row, kind="stable")  # hottest first, ties by expert id
        cum = np.cumsum(row[order])
        total = int(table[layer].sum())
        out.append({
            "layer": layer, "routed": total,
            "top1_share": round(float(cum[0]), 6) if total else 0.0,
            "experts_for_50": _needed(cum, 0.5) if total else None,
            "experts_for_90": _needed(cum, 0.9) if total else None,
            "unused": int((table[layer] == 0).sum()),
            "hot": [int(e) for e in order[:hot] if table[layer, e] > 0],
        })
    return out


def _needed(cum: np.ndarray, target: float) -> int:
    # 1e-12 guards against 0.8999999 from float summation
    return int(np.searchsorted(cum, target - 1e-12) + 1)


def placement_keys(counts: ExpertCounts | np.ndarray, slots: int, top_k: int | None = None, *,
                   max_per_layer: int | None = None) -> list[tuple[int, int]]:
    """The ``slots`` best (layer, expert) pairs to keep resident, best first.

    ``slots`` is the number of slots the plan may take (the pinned or seeded
    budget, not the whole cache). ``max_per_layer`` caps each layer (per-layer
    partitions must keep ``top_k`` slots free). Experts never routed to are
    never placed, so the plan can be shorter than the budget. ``top_k`` only
    checks that the counts fit the model (a layer needs at least top_k experts).
    """
    table = as_count_array(counts, "counts")
    _check_count("slots", slots, allow_zero=True)
    if top_k is not None:
        _check_count("top_k", top_k)
        if top_k > table.shape[1]:
            raise ValueError(f"top_k={top_k} exceeds the {table.shape[1]} experts per layer in the counts")
    if max_per_layer is not None:
        _check_count("max_per_layer", max_per_layer, allow_zero=True)
    shares = layer_shares(table).ravel()
    order = np.lexsort((np.arange(shares.size), -shares))  # share desc, then layer, expert
    E = table.shape[1]
    taken = np.zeros(table.shape[0], dtype=np.int64)
    plan: list[tuple[int, int]] = []
    for flat in order:
        if len(plan) >= slots or shares[flat] <= 0:
            break
        layer, expert = divmod(int(flat), E)
        if max_per_layer is not None and taken[layer] >= max_per_layer:
            continue
        taken[layer] += 1
        plan.append((layer, expert))
    return plan


def plan_coverage(counts: ExpertCounts | np.ndarray, plan: list[tuple[int, int]]) -> dict:
    """Share of routed tokens the plan's experts received: per layer and the mean over layers.

    The mean is the hit rate the plan alone would give on a workload routed
    like the counts (every layer weighs the same: each token passes each once).
    """
    shares = layer_shares(as_count_array(counts, "counts"))
    per_layer = np.zeros(shares.shape[0])
    pinned = np.zeros(shares.shape[0], dtype=np.int64)
    for layer, expert in plan:
        per_layer[layer] += shares[layer, expert]
        pinned[layer] += 1
    return {"mean_share": round(float(per_layer.mean()), 6),
            "per_layer_share": [round(float(v), 6) for v in per_layer],
            "per_layer_slots": pinned.tolist()}


def _check_count(name: str, value: object, allow_zero: bool = False) -> None:
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        what = "a whole number >= 0" if allow_zero else "a positive whole number"
        raise ValueError(f"{name} must be {what}, got {value!r}")
