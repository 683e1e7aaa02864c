"""``expertcache imatrix FILE``: per-layer expert coverage and a placement plan for a slot budget."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .paths import check_output


def add_parser(sub) -> None:
    p = sub.add_parser("imatrix", help="what an imatrix (or trace, popularity JSON, .npy) says about "
                                       "each layer's experts, and which to place on the GPU",
                       # argparse %-formats help strings but prints a description as written
                       description="Per-layer coverage (hottest share, experts for 50%/90% of routed "
                                   "tokens, hot list) and a placement plan: the (layer, expert) pairs "
                                   "to pin for a slot budget, shared across layers by concentration.")
    p.add_argument("file", help="imatrix .gguf (legacy .dat is explained), trace .npz, popularity .json or .npy")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--slots", type=int, help="slots the plan may take (default: 12.5%% of all experts)")
    budget.add_argument("--fraction", type=float, help="plan budget as a share of all experts, 0..1")
    p.add_argument("--kind", choices=("imatrix", "trace", "json", "npy"), help="source type (default: guessed)")
    p.add_argument("--top-k", type=int, help="experts per token, to check the counts fit the model")
    p.add_argument("--hot", type=int, default=8, help="experts in each layer's hot list (default 8)")
    p.add_argument("--json", metavar="OUT", help="write the report as JSON ('-' for stdout)")
    p.add_argument("--plot", metavar="OUT.png", help="save coverage curves and a share heatmap")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..imatrix import load_counts
    from ..imatrix.report import build_report, format_report, plan_slots

    if args.hot < 0:
        raise ValueError(f"--hot must be >= 0, got {args.hot}")
    check_output(args.json, "--json")
    check_output(args.plot, "--plot")
    counts = load_counts(Path(args.file), args.kind)
    report = build_report(counts, plan_slots(counts, args.slots, args.fraction), args.top_k, args.hot)
    if args.json == "-":
        print(json.dumps(report))
    else:
        print(format_report(report))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
            print(f"wrote {args.json}")
    if args.plot:
        from ..imatrix.plot import save_plot

        save_plot(counts.counts, [tuple(p) for p in report["plan"]], args.plot, title=Path(args.file).name)
        print(f"wrote {args.plot}", file=sys.stderr if args.json == "-" else sys.stdout)
    return 0
