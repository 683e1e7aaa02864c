"""Replays with an imatrix plan pinned or seeded: what ``expertcache sim --imatrix`` runs.

The plan is rebuilt for every cache size (a pin plan takes at most half of each
partition by default, see ``apply``), so a sweep compares like with like.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..imatrix.apply import check_mode, plan_keys
from ..imatrix.counts import ExpertCounts
from .replay import Prepared, replay


def imatrix_replays(prep, policies: Sequence[str], slots_list: Sequence[int], partition: str,
                    source, mode: str = "pin", budget: int | None = None) -> list:
    """``ReplayResult`` per (policy, size), in that order, each labelled with the plan it ran."""
    if check_mode(mode) == "none":
        raise ValueError("imatrix mode 'none' places nothing; use 'pin' or 'seed'")
    prep = prep if isinstance(prep, Prepared) else Prepared(prep)
    if not isinstance(source, ExpertCounts):
        from ..imatrix.sources import load_counts

        source = load_counts(Path(source))
    trace = prep.trace
    out = []
    for policy in policies:
        for slots in dict.fromkeys(int(s) for s in slots_list):
            keys = plan_keys(source, num_layers=trace.num_layers, num_experts=trace.num_experts,
                             slots=slots, partition=partition, top_k=trace.top_k, mode=mode,
                             budget=budget)
            placed = {"pinned": keys} if mode == "pin" else {"seed": keys}
            result = replay(prep, policy, slots, partition, **placed)
            result.label = f"{result.label} {mode}={len(keys)}"
            out.append(result)
    return out
