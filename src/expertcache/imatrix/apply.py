"""Put an imatrix placement plan into a SlotTable: pin it or seed it.

``pin`` keeps the plan's experts resident for good (the same mechanism as the
table's ``pinned=`` keys and the ``static`` policy); the eviction policy then
manages only the slots left over. ``seed`` preloads them into free slots at
start and lets the policy evict them like any other expert (a warm start).

Budgets (documented in docs/imatrix.md): a pin plan takes at most half of
each partition by default and never so much that fewer than ``top_k`` dynamic
slots remain (one step needs up to top_k experts at once); a seed plan may
fill the whole cache, since seeds can leave.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from ..cache import Plan, SlotTable
from .counts import ExpertCounts, as_count_array
from .placement import placement_keys

MODES = ("none", "pin", "seed")
PIN_FRACTION = 0.5  # default share of each partition a pin plan may take


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown imatrix mode {mode!r}; use one of {', '.join(MODES)}")
    return mode


def table_plan(counts: ExpertCounts, table: SlotTable, mode: str,
               budget: int | None = None) -> list[tuple[int, int]]:
    """The placement plan that fits ``table`` for ``mode`` (``budget`` = slots it may take)."""
    check_mode(mode)
    table_counts = as_count_array(counts, "counts")
    if table_counts.shape != (table.num_layers, table.num_experts):
        where = getattr(counts, "source", "") or "counts"
        raise ValueError(f"{where}: counts are for {table_counts.shape[0]} layers x {table_counts.shape[1]} "
                         f"experts but the cache is for {table.num_layers} x {table.num_experts}; "
                         "use an imatrix of the same model")
    if mode == "none":
        return []
    total, per_layer = _budget(table, mode, budget)
    return placement_keys(table_counts, total, table.top_k, max_per_layer=per_layer)


def _budget(table: SlotTable, mode: str, budget: int | None) -> tuple[int, int | None]:
    """(slots the plan may take, cap per layer or None) for this table and mode."""
    top_k = table.top_k or 1
    per_layer = table.partition == "per-layer"
    cap = table.partition_capacity - (0 if per_layer else len(table.pinned))
    limit = cap - top_k if mode == "pin" else cap   # most slots one partition may give
    default = min(int(cap * PIN_FRACTION), limit) if mode == "pin" else cap
    parts = table.num_layers if per_layer else 1
    if budget is None:
        return default * parts, (default if per_layer else None)
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ValueError(f"imatrix budget must be a whole number of slots >= 0, got {budget!r}")
    per_part = -(-budget // parts)  # ceil: the most any one partition is asked for
    if per_part > limit:
        where = f"each layer's {cap} slots" if per_layer else f"the pool's {cap} free slots"
        need = f" and leave top_k={top_k} for the step" if mode == "pin" else ""
        raise ValueError(f"imatrix {mode} budget of {budget} slots does not fit {where}{need}; "
                         f"use at most {limit * parts}")
    return budget, (per_part if per_layer else None)


def apply_imatrix(table: SlotTable, keys, mode: str) -> Plan:
    """Pin or seed ``keys`` ((layer, expert) pairs or int keys) in a fresh table.

    Returns a Plan whose ``loads`` map each placed key to its slot (the copies a
    runtime must make before the first step).
    """
    check_mode(mode)
    keys = [table.as_key(k) for k in keys]
    if mode == "none" or not keys:
        return Plan()
    if mode == "seed":
        return table.seed(keys)
    _check_fresh(table)
    _check_pin_fits(table, keys)
    return table.pin(keys)


def _check_fresh(table: SlotTable) -> None:
    dynamic = set(table.resident()) - table.pinned
    if dynamic or table.stats().total().accesses:
        raise ValueError("imatrix pin needs a fresh cache (no steps run, nothing seeded): pin before "
                         "the first step, or use mode 'seed'")


def _check_pin_fits(table: SlotTable, keys: list[int]) -> None:
    top_k = table.top_k or 1
    E = table.num_experts
    new = set(keys) - table.pinned
    if table.partition == "global":
        loads = Counter({0: len(new) + len(table.pinned)})
    else:
        loads = Counter(k // E for k in new | table.pinned)
    cap = table.partition_capacity
    for part, n in loads.items():
        if cap - n < top_k:
            where = "the pool" if table.partition == "global" else f"layer {part}'s partition"
            raise ValueError(f"pinning {n} experts in {where} of {cap} slots leaves {cap - n} for "
                             f"everything else, fewer than top_k={top_k}; pin at most {cap - top_k}")


def place(table: SlotTable, source, mode: str, budget: int | None = None) -> Plan:
    """Load counts from ``source`` (a path or ExpertCounts), plan for ``table`` and apply.

    The one call a simulator or runtime needs for ``--imatrix FILE --imatrix-mode``.
    """
    if check_mode(mode) == "none":
        return Plan()
    if not isinstance(source, ExpertCounts):
        from .sources import load_counts

        source = load_counts(Path(source))
    return apply_imatrix(table, table_plan(source, table, mode, budget), mode)


def plan_keys(source, *, num_layers: int, num_experts: int, slots: int, partition: str = "global",
              top_k: int | None = None, mode: str = "pin", budget: int | None = None) -> list[int]:
    """Int keys (``layer * num_experts + expert``) of the plan for a cache of this shape.

    For code that builds its own table, e.g. ``sim.replay(..., pinned=keys)`` or
    ``seed=keys``: the same plan ``place`` would apply, checked the same way.
    """
    if check_mode(mode) == "none":
        return []
    if not isinstance(source, ExpertCounts):
        from .sources import load_counts

        source = load_counts(Path(source))
    probe = SlotTable(num_layers, num_experts, slots, partition=partition, top_k=top_k)
    return [layer * num_experts + expert for layer, expert in table_plan(source, probe, mode, budget)]


def check_source(source, num_layers: int, num_experts: int) -> ExpertCounts:
    """Load counts and check their shape early (e.g. before a runtime takes a model apart)."""
    if not isinstance(source, ExpertCounts):
        from .sources import load_counts

        source = load_counts(Path(source))
    if (source.num_layers, source.num_experts) != (num_layers, num_experts):
        raise ValueError(f"{source.source or 'counts'}: counts are for {source.num_layers} layers x "
                         f"{source.num_experts} experts but the model has {num_layers} MoE layers x "
                         f"{num_experts} experts; use an imatrix of the same model")
    return source
