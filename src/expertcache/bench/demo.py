"""``expertcache demo``: the simulator's policy table, then the live benchmark, then a verdict.

On the built-in default trace (synthetic Qwen3-30B-A3B routing, 1000 tokens, 64 of
them prompt): first every chosen policy is replayed by the simulator on all 48
layers (hit rates against Belady), then the first ``layers`` MoE layers run for real
at ``scale`` of the model's expert size (default: full size, 4 layers) with the
runtime's slot pool, baselines, the default policy and belady side by side.
Everything it draws or writes goes to ``out``.
"""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

DEMO_POLICIES = ("default", "lru", "lfu", "slru", "s3fifo", "arc", "belady")
FRACTIONS = (0.125, 0.25, 0.5)


def sim_part(trace, out: Path, workers: int | None = None) -> list[dict]:
    """Replay the policies at each fraction; print the table, draw the curves, save JSON."""
    from ..cli.sim import _print_table
    from ..policies.registry import eviction_policies
    from ..sim.hardware import load_hardware
    from ..sim.mrc import sweep
    from ..sim.plot import plot_curves
    from ..sim.replay import Prepared, slots_for_fraction
    from ..sim.report import document, expert_cost, rows

    known = eviction_policies()
    policies = [p for p in DEMO_POLICIES if p in known] or ["lru", "belady"]
    slots = [slots_for_fraction(trace, f) for f in FRACTIONS]
    prep = Prepared(trace)
    results = sweep(prep, policies, slots, "global", workers=workers)
    opt = {r.slots: r.misses for r in results if r.policy == "belady"}
    hw = load_hardware("pcie4-consumer")
    cost = expert_cost(trace, model=trace.meta["model"])
    table = rows(trace, results, opt, cost, hw, "auto")
    _print_table(trace, table, hw.name, True)
    plot_curves(results, out / "sim_hit_rate.png",
                title=f"{trace.meta['model']} (synthetic): {trace.num_tokens} tokens, global pool",
                total_experts=trace.num_layers * trace.num_experts)
    (out / "sim.json").write_text(json.dumps(document(trace, table, hw, "auto", cost), indent=2) + "\n")
    return table


def bench_args(tokens: int, layers: int, scale: float, dtype: str, device: str,
               threads: int | None) -> Namespace:
    """The ``bench`` options the demo runs with (what ``expertcache bench`` would parse)."""
    return Namespace(trace=None, preset=None, tokens=tokens, layers=layers, scale=scale, dtype=dtype,
                     policy=None, slots=None, fraction=",".join(map(str, FRACTIONS)),
                     partition="global", no_belady=False, baselines="resident,copy-every-pass,cpu",
                     device=device,
                     hardware="calibrate", threads=threads, seed=0, clock="auto")


def sim_summary(table: list[dict]) -> str:
    """One sentence on the simulator: the best causal policy at 25% against the optimum."""
    sizes = sorted({r["slots"] for r in table})
    mid = sizes[len(sizes) // 2]
    at = [r for r in table if r["slots"] == mid]
    causal = [r for r in at if r["policy"] != "belady"]
    if not causal:
        return ""
    best = max(causal, key=lambda r: r["hit_rate"])
    opt = next((r for r in at if r["policy"] == "belady"), None)
    text = f"Simulator, {mid} slots: best policy {best['label']} hits {best['hit_rate']:.1%}"
    return text + (f" (Belady {opt['hit_rate']:.1%})." if opt else ".")
