"""Each policy's misses over Belady's on every trace: the table in docs/policies.md.

For every trace, partition (global, per-layer) and capacity (12.5% and 25% of
all experts) it replays Belady (exact optimum, forced admission) and each
policy through the simulator (cold start, token-major steps) and prints
misses / Belady misses, plus the average over the configurations. With
--timing it also prints the cost per access of each policy through SlotTable.

    .venv/bin/python benchmarks/policy_research.py                       # shared traces, all tokens
    .venv/bin/python benchmarks/policy_research.py --tokens 2000 --traces code
    .venv/bin/python benchmarks/policy_research.py --traces synth:qwen3-30b-a3b:4000 --json out.json
    .venv/bin/python benchmarks/policy_research.py --from-json benchmarks/results/policy_research.json \
        --plot docs/img/policies-vs-belady.png

Traces: ``code``, ``general`` (../shared/traces/qwen3-30b-a3b-*.npz), ``phone``
(the top-6 route CSV there), ``synth:PRESET:TOKENS`` (expertcache.trace.synth).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from expertcache.policies.registry import parse_spec
from expertcache.sim.replay import Prepared, replay
from expertcache.trace import load_trace

SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces"
POLICIES = ("lru", "fifo", "lfu", "slru", "lfru", "arc", "s3fifo", "next-use")
CONFIGS = tuple((part, frac) for part in ("global", "per-layer") for frac in (0.125, 0.25))


def load(name: str, tokens: int):
    """A trace by short name (see module doc), cut to its first ``tokens`` (0 = all)."""
    if name in ("code", "general"):
        trace = load_trace(SHARED / f"qwen3-30b-a3b-{name}.npz")
    elif name == "phone":
        from expertcache.trace.importers import import_route_csv
        trace = import_route_csv(SHARED / "qwen3-30b-a3b-top6-phone.route.csv").trace
    elif name.startswith("synth:"):
        from expertcache.trace.synth import synth_trace
        _, preset, count = (name.split(":") + ["4000"])[:3]
        trace = synth_trace(preset, int(count), seed=0)
    else:
        raise ValueError(f"unknown trace {name!r}; use code, general, phone or synth:PRESET:TOKENS")
    return trace.slice_tokens(tokens) if tokens and tokens < trace.num_tokens else trace


def slots_of(trace, frac: float) -> int:
    return round(frac * trace.num_layers * trace.num_experts)


def ratios(prep: Prepared, policies, progress=None) -> dict:
    """{config: {"belady": misses, policy: misses/belady}} for one trace."""
    out = {}
    for part, frac in CONFIGS:
        slots = slots_of(prep.trace, frac)
        if part == "per-layer" and slots // prep.L <= prep.trace.top_k:
            continue  # below top-k it cannot serve a step; at top-k every policy is optimal
        best = replay(prep, "belady", slots, part).misses
        row = {"slots": slots, "belady": best}
        for spec in policies:
            row[spec] = replay(prep, spec, slots, part).misses / best
            if progress:
                progress(f"{part} {frac} {spec} {row[spec]:.3f}")
        out[f"{part} {frac:g}"] = row
    return out


def cost_per_access(prep: Prepared, policies, slots: int) -> dict[str, float]:
    """Microseconds per access through SlotTable (global pool), table overhead included."""
    out = {}
    for spec in policies:
        eviction, _ = parse_spec(spec)
        if eviction == "belady":
            continue
        t0 = time.process_time()
        res = replay(prep, spec, slots, "global", engine="table")
        out[spec] = (time.process_time() - t0) / res.accesses * 1e6
    return out


def table(results: dict, policies) -> str:
    """Markdown: one row per trace x config, one column per policy; then averages."""
    lines = ["| trace | config | Belady misses | " + " | ".join(policies) + " |",
             "|---|---|---|" + "---|" * len(policies)]
    for name, rows in results.items():
        for config, row in rows.items():
            cells = " | ".join(f"{row[p]:.2f}" for p in policies)
            lines.append(f"| {name} | {config} | {row['belady']} | {cells} |")
        avg = {p: sum(r[p] for r in rows.values()) / len(rows) for p in policies}
        lines.append(f"| {name} | **average** | | " + " | ".join(f"**{avg[p]:.2f}**" for p in policies) + " |")
    return "\n".join(lines)


def plot(results: dict, policies, path: Path, goal: float = 1.4, top: float = 3.0) -> Path:
    """One panel per trace: misses / Belady's per configuration, a bar per policy.

    Bars above ``top`` are cut there and labelled with their value, so that one outlier
    (slru's frozen protected segment) does not flatten the rest."""
    import matplotlib
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results) + 1.5, 4), dpi=120,
                             sharey=True, squeeze=False)
    width = 0.8 / len(policies)
    for ax, (name, rows) in zip(axes[0], results.items()):
        configs = list(rows) + ["average"]
        for i, pol in enumerate(policies):
            vals = [rows[c][pol] for c in rows]
            vals.append(sum(vals) / len(vals))
            xs = [x + (i - len(policies) / 2 + 0.5) * width for x in range(len(configs))]
            ax.bar(xs, [min(v, top) for v in vals], width, label=pol)
            for x, v in zip(xs, vals):
                if v > top:
                    ax.text(x, top, f"{v:.1f}", ha="center", va="bottom", fontsize=7)
        ax.axhline(1.0, color="k", lw=1)
        ax.axhline(goal, color="k", ls="--", lw=1)
        ax.set_xticks(range(len(configs)), [c.replace(" ", "\n") for c in configs], fontsize=8)
        ax.set_title(name, fontsize=10)
        ax.set_ylim(0.9, top + 0.15)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel(f"misses / Belady's (dashed: goal {goal}x)")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _drop_trivial(results: dict) -> dict:
    """Rows where every policy equals Belady exactly (a partition of top-k slots) say nothing."""
    return {name: {cfg: row for cfg, row in rows.items()
                   if any(v != 1.0 for k, v in row.items() if k not in ("slots", "belady"))}
            for name, rows in results.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", nargs="+", default=["code", "general"])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--tokens", type=int, default=0, help="first N tokens of each trace (0 = all)")
    ap.add_argument("--timing", action="store_true", help="also measure microseconds per access")
    ap.add_argument("--json", type=Path, help="save figures here")
    ap.add_argument("--from-json", type=Path, help="print the table of a saved run instead")
    ap.add_argument("--plot", type=Path, help="draw the ratios as bars to this PNG")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.from_json:
        results = _drop_trivial(json.loads(args.from_json.read_text())["ratios"])
        print(table(results, args.policies))
        if args.plot:
            print(f"plot: {plot(results, args.policies, args.plot)}")
        return 0
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if args.verbose else None
    results, costs = {}, {}
    for name in args.traces:
        prep = Prepared(load(name, args.tokens))
        results[name] = ratios(prep, args.policies, log)
        if args.timing:
            costs[name] = cost_per_access(prep, args.policies, slots_of(prep.trace, 0.125))
    print(table(results, args.policies))
    for name, cost in costs.items():
        print(f"\nµs per access through SlotTable ({name}, global 12.5%): "
              + ", ".join(f"{p} {us:.2f}" for p, us in cost.items()))
    if args.plot:
        print(f"plot: {plot(results, args.policies, args.plot)}")
    if args.json:
        args.json.write_text(json.dumps({"ratios": results, "us_per_access": costs,
                                         "tokens": args.tokens or "all",
                                         "machine": platform.platform(),
                                         "python": platform.python_version()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
