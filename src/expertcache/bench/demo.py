"""``run_demo``: the simulator's policy table, then the live benchmark, then a verdict.

On the built-in default trace (synthetic Qwen3-30B-A3B routing, 1000 tokens, 64 of
them prompt): first every chosen policy is replayed by the simulator on all 48
layers (hit rates against Belady), then the first ``layers`` MoE layers run for real
at ``scale`` of the model's expert size (default: full size, 4 layers) with the
runtime's slot pool, baselines, the default policy and belady side by side.
Everything it draws or writes goes to ``out``; ``expertcache demo`` prints the result.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .api import FRACTIONS, run_bench

DEMO_POLICIES = ("default", "lru", "lfu", "slru", "s3fifo", "arc", "belady")
SIM_HARDWARE = "pcie4-consumer"  # the cost model the simulator table predicts tok/s with
FILES = ("sim_hit_rate.png", "bench_tok_s.png", "sim.json", "bench.json")


@dataclass
class Demo:
    """What a demo run produced: the simulator rows, the bench document, the words."""

    sim: list[dict]
    bench: dict
    files: list[Path] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        from .report import verdict
        return "\n".join(t for t in (sim_summary(self.sim), verdict(self.bench["results"])) if t)


def run_demo(out: str | Path = "demo-out", *, tokens: int = 160, layers: int = 4, scale: float = 1.0,
             dtype: str = "bf16", device: str = "auto", threads: int | None = 1,
             hardware: str | None = "calibrate", workers: int | None = None,
             on_sim: Callable[[object, list[dict]], None] = lambda _trace, _rows: None,
             progress: Callable[[str], None] = lambda _msg: None) -> Demo:
    """Both parts on the built-in trace; plots and JSON into the folder ``out`` (created, but
    not its parents). ``on_sim(trace, rows)`` sees the simulator's table before the (longer)
    live part starts."""
    from ..trace.synth import default_trace
    from .plot import plot_tok_s, title

    out = Path(out)
    out.mkdir(exist_ok=True)
    trace = default_trace()
    table = sim_part(trace, out, workers)
    on_sim(trace, table)
    doc = run_bench(tokens=tokens, layers=layers, scale=scale, dtype=dtype, fractions=FRACTIONS,
                    device=device, hardware=hardware, threads=threads, progress=progress)
    (out / "bench.json").write_text(json.dumps(doc, indent=2) + "\n")
    plot_tok_s(doc["results"], out / "bench_tok_s.png", title=title(doc))
    return Demo(table, doc, [out / name for name in FILES])


def sim_part(trace, out: Path, workers: int | None = None) -> list[dict]:
    """Replay the policies at each fraction; draw the curves, save JSON, return the rows."""
    from ..policies.registry import eviction_policies
    from ..costmodel.hardware import load_hardware
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
    hw = load_hardware(SIM_HARDWARE)
    cost = expert_cost(trace, model=trace.meta["model"])
    table = rows(trace, results, opt, cost, hw, "auto")
    plot_curves(results, out / "sim_hit_rate.png",
                title=f"{trace.meta['model']} (synthetic): {trace.num_tokens} tokens, global pool",
                total_experts=trace.num_layers * trace.num_experts)
    (out / "sim.json").write_text(json.dumps(document(trace, table, hw, "auto", cost), indent=2) + "\n")
    return table


def sim_notes(trace, table: list[dict]) -> list[str]:
    """What a reader of the simulator table asks about: slru far under lru where its probation
    segment holds less than one token's expert uses (measured: table and kernel agree, so it is
    the policy, not a bug; docs/bench.md)."""
    from ..sim.replay import resolve_policy

    lru = {r["slots"]: r["hit_rate"] for r in table if r["policy"] == "lru" and r["admission"] == "always"}
    notes = []
    for r in table:
        if r["policy"] != "slru" or r["hit_rate"] >= lru.get(r["slots"], 0.0):
            continue
        L, k = trace.num_layers, trace.top_k
        share = resolve_policy(r["label"]).eviction_params["protected"]
        probation = r["slots"] - int(share * r["slots"])  # what slru leaves outside its protected segment
        if probation < L * k:
            notes.append(f"slru at {r['slots']} slots: its probation segment ({probation} slots, {1 - share:.0%}) "
                         f"holds less than one token's {L * k} expert uses ({L} layers x top-{k}), so a newly "
                         "loaded expert is mostly evicted before its layer comes round again and is never "
                         "promoted; the protected segment keeps the experts promoted early. A policy "
                         "weakness at this size, not a bug: a larger probation (slru:protected=0.5) fixes it.")
    return notes


def sim_summary(table: list[dict]) -> str:
    """One sentence on the simulator: the best causal policy at 25% against the optimum."""
    sizes = sorted({r["slots"] for r in table})
    if not sizes:
        return ""
    mid = sizes[len(sizes) // 2]
    at = [r for r in table if r["slots"] == mid]
    causal = [r for r in at if r["policy"] != "belady"]
    if not causal:
        return ""
    best = max(causal, key=lambda r: r["hit_rate"])
    opt = next((r for r in at if r["policy"] == "belady"), None)
    text = f"Simulator, {mid} slots: best policy {best['label']} hits {best['hit_rate']:.1%}"
    return text + (f" (Belady {opt['hit_rate']:.1%})." if opt else ".")
