"""The ``expertcache imatrix`` report: coverage per layer plus a placement plan, as JSON or text."""

from __future__ import annotations

from ..config import fraction_slots
from .counts import ExpertCounts
from .placement import coverage, placement_keys, plan_coverage

DEFAULT_FRACTION = 0.125  # plan budget when neither slots nor fraction is given


def plan_slots(counts: ExpertCounts, slots: int | None, fraction: float | None) -> int:
    """Slots for the plan: ``slots`` as given, or ``fraction`` of all (layer, expert) pairs."""
    total = counts.num_layers * counts.num_experts
    if slots is not None and fraction is not None:
        raise ValueError("give either slots or fraction, not both")
    if slots is not None:
        if isinstance(slots, bool) or not isinstance(slots, int) or not 0 <= slots <= total:
            raise ValueError(f"slots must be a whole number in 0..{total} (layers x experts), got {slots!r}")
        return slots
    return fraction_slots(DEFAULT_FRACTION if fraction is None else fraction, total)


def build_report(counts: ExpertCounts, slots: int, top_k: int | None = None, hot: int = 8) -> dict:
    """The ``--json`` document: layers, experts, counts, coverage, plan, plus context (docs/imatrix.md)."""
    plan = placement_keys(counts, slots, top_k)
    covered = plan_coverage(counts, plan)
    return {
        "source": counts.source, "kind": counts.kind, "metadata": _jsonable(counts.meta),
        "layers": counts.num_layers, "experts": counts.num_experts,
        "counts": counts.counts.tolist(),
        "coverage": coverage(counts, hot=hot),
        "budget": slots,
        "plan": [[layer, expert] for layer, expert in plan],
        "plan_share": covered["mean_share"],
        # What the same number of experts would cover if routing were uniform.
        "uniform_share": round(len(plan) / (counts.num_layers * counts.num_experts), 6),
        "plan_per_layer": covered["per_layer_slots"],
        "plan_share_per_layer": covered["per_layer_share"],
    }


def _jsonable(meta: dict) -> dict:
    return {k: (v if isinstance(v, (str, int, float, list, type(None))) else str(v)) for k, v in meta.items()}


def format_report(report: dict) -> str:
    """A terminal table, one row per layer, and a summary of the plan."""
    meta = report["metadata"]
    lines = [f"{report['source']}: {report['kind']}, {report['layers']} MoE layers x {report['experts']} experts"]
    if meta.get("datasets") or meta.get("chunk_count") is not None:
        lines.append(f"  datasets {', '.join(meta.get('datasets') or ['?'])}; "
                     f"{meta.get('chunk_count')} chunks of {meta.get('chunk_size')} tokens")
    lines.append(f"{'layer':>5} {'routed':>9} {'top1':>6} {'n50':>4} {'n90':>4} {'unused':>6} "
                 f"{'plan':>4} {'plan%':>6}  hot experts")
    for row, slots, share in zip(report["coverage"], report["plan_per_layer"], report["plan_share_per_layer"]):
        n50 = "-" if row["experts_for_50"] is None else row["experts_for_50"]
        n90 = "-" if row["experts_for_90"] is None else row["experts_for_90"]
        lines.append(f"{row['layer']:>5} {row['routed']:>9} {row['top1_share']:>6.3f} {n50:>4} {n90:>4} "
                     f"{row['unused']:>6} {slots:>4} {100 * share:>5.1f}%  "
                     f"{' '.join(map(str, row['hot']))}")
    lines.append(f"plan: {len(report['plan'])} of {report['budget']} slots; its experts received "
                 f"{100 * report['plan_share']:.1f}% of routed tokens (uniform routing: "
                 f"{100 * report['uniform_share']:.1f}%)")
    if len(report["plan"]) < report["budget"]:
        lines.append("  (shorter than the budget: experts with zero counts are never placed)")
    lines.append("  whether pinning beats a recency cache depends on the workload: replay a trace "
                 "with `--imatrix` in the simulator before pinning (docs/imatrix.md)")
    return "\n".join(lines)
