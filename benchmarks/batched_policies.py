"""Policies under batched decode, scored against the true optimum: the batched table in
docs/policies.md.

Each shared trace is cut into B requests decoded together (``expertcache trace batch``:
one token per request per step, each layer's step the union of the batch's experts) and
replayed by the simulator at 12.5% and 25% of all experts, global and per-layer. Every
policy's misses are divided by the lower optimum (``opt``: the lower of Belady's, forced
admission, and MIN with bypass's, ``belady+oracle``), then averaged over the configurations.

    PYTHONPATH=src .venv/bin/python benchmarks/batched_policies.py                  # B = 1, 4, 16
    PYTHONPATH=src .venv/bin/python benchmarks/batched_policies.py --requests 4 16 \\
        --policies default lru random --json benchmarks/results/batched_policies.json
    PYTHONPATH=src .venv/bin/python benchmarks/batched_policies.py \\
        --from-json benchmarks/results/batched_policies.json --plot docs/img/batched-policies.png

Traces: ``code`` and ``general`` (../shared/traces/qwen3-30b-a3b-*.npz).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from expertcache.sim.replay import Prepared, replay
from expertcache.trace import load_trace
from expertcache.trace.batch import batch_traces

SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces"
POLICIES = ("default", "lru", "random", "next-use", "belady")
OPTIMA = ("belady", "belady+oracle")


def configs(requests, fractions, partitions):
    return [(b, part, frac) for b in requests for part in partitions for frac in fractions]


def measure(trace_name: str, trace, b: int, part: str, frac: float, policies) -> dict:
    """Misses of the optima and every policy at one configuration."""
    prep = Prepared(batch_traces([trace], b))
    slots = round(frac * trace.num_layers * trace.num_experts)
    row = {"trace": trace_name, "requests": b, "partition": part, "fraction": frac,
           "slots": slots, "misses": {}, "hit_rate": {}}
    for policy in dict.fromkeys([*OPTIMA, *policies]):
        r = replay(prep, policy, slots, part)
        row["misses"][policy], row["hit_rate"][policy] = r.misses, r.hit_rate
    row["opt"] = min(row["misses"][p] for p in OPTIMA)
    return row


def table(rows: list[dict], policies) -> str:
    """Misses over the lower optimum (hit rate in brackets), one line per configuration,
    then each policy's average per B and over all."""
    cols = list(dict.fromkeys([*OPTIMA, *policies]))
    out = ["| trace | B | config | opt misses | " + " | ".join(cols) + " |",
           "|---|---|---|---|" + "---|" * len(cols)]
    for r in rows:
        cells = [f"{r['misses'][p] / r['opt']:.2f} ({r['hit_rate'][p]:.3f})" for p in cols]
        out.append(f"| {r['trace']} | {r['requests']} | {r['partition']} {r['fraction']} | "
                   f"{r['opt']} | " + " | ".join(cells) + " |")
    groups = sorted({r["requests"] for r in rows})
    for b in [*groups, None]:
        sel = [r for r in rows if b is None or r["requests"] == b]
        avg = [sum(r["misses"][p] / r["opt"] for r in sel) / len(sel) for p in cols]
        out.append(f"| **average** | {b if b is not None else 'all'} | | | "
                   + " | ".join(f"{a:.2f}" for a in avg) + " |")
    return "\n".join(out)


def plot(rows: list[dict], policies, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cols = [p for p in dict.fromkeys(policies) if p not in OPTIMA]
    labels = [f"{r['trace'][0]} B{r['requests']} {r['partition'][0]}{r['fraction']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.5), 4))
    w = 0.8 / len(cols)
    for i, p in enumerate(cols):
        ax.bar([x + i * w for x in range(len(rows))],
               [min(r["misses"][p] / r["opt"], 4) for r in rows], w, label=p)
    ax.axhline(1.4, ls="--", c="k", lw=0.8)
    ax.set_xticks([x + 0.4 for x in range(len(rows))], labels, rotation=90, fontsize=7)
    ax.set_ylabel("misses / lower optimum (cut at 4)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", nargs="+", default=["code", "general"])
    ap.add_argument("--requests", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--fractions", nargs="+", type=float, default=[0.125, 0.25])
    ap.add_argument("--partitions", nargs="+", default=["global", "per-layer"])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--tokens", type=int, default=0, help="first N tokens of each trace (0 = all)")
    ap.add_argument("--json", help="write every row as JSON")
    ap.add_argument("--from-json", help="print (and plot) a saved run instead of measuring")
    ap.add_argument("--plot", help="draw misses over the optimum per configuration (PNG)")
    args = ap.parse_args(argv)
    if args.from_json:
        doc = json.loads(Path(args.from_json).read_text())
        rows, policies = doc["rows"], doc["policies"]
    else:
        rows, policies = [], args.policies
        todo = [(name, c) for name in args.traces
                for c in configs(args.requests, args.fractions, args.partitions)]
        start = time.time()
        for i, (name, (b, part, frac)) in enumerate(todo):
            trace = load_trace(SHARED / f"qwen3-30b-a3b-{name}.npz")
            if args.tokens and args.tokens < trace.num_tokens:
                trace = trace.slice_tokens(args.tokens)
            rows.append(measure(name, trace, b, part, frac, policies))
            print(f"[{i + 1}/{len(todo)}] {name} B={b} {part} {frac}: "
                  f"{time.time() - start:.0f} s", file=sys.stderr, flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({
                "command": "benchmarks/batched_policies.py " + " ".join(argv or sys.argv[1:]),
                "machine": platform.platform(), "policies": policies, "rows": rows}, indent=1) + "\n")
    print(table(rows, policies))
    if args.plot:
        plot(rows, policies, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
