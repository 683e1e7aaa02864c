"""``expertcache demo``: what ``make demo`` runs, in about three minutes on two cores.

The live part runs real-size Qwen3-30B-A3B experts (9 MiB in bf16) on the first 4 MoE
layers: at smaller expert sizes copies get cheap next to the fixed per-step cost and
the comparison stops saying anything about real models.

Prints the simulator's policy table on the built-in synthetic trace, runs the decode
benchmark (baselines, the default policy and belady at 12.5/25/50% of the experts)
on real expert weights, writes both plots and the JSON files to ``--out``, and ends
with a plain-language verdict.
"""

from __future__ import annotations

import sys

from .paths import check_output_dir


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="simulator table + live benchmark on the built-in trace, with plots",
                       description=__doc__)
    p.add_argument("--out", default="demo-out",
                   help="folder for plots and JSON (default ./demo-out; created, its parent must exist)")
    p.add_argument("--tokens", type=int, default=160,
                   help="tokens the live benchmark replays (default 160, 64 of them prompt)")
    p.add_argument("--layers", type=int, default=4,
                   help="MoE layers the live benchmark runs (default 4: 4.5 GiB of experts, plus as "
                        "much again for 'resident' when memory allows)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="expert size relative to Qwen3-30B-A3B (default 1: real 9 MiB bf16 experts)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--device", default="auto", help="auto (cuda if present), cpu or cuda")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: steady timings on a shared machine)")
    p.set_defaults(func=run)


def run(args) -> int:
    check_output_dir(args.out, "--out")
    from rich.console import Console

    from ..bench.checks import summary
    from ..bench.demo import FILES, SIM_HARDWARE, run_demo, sim_notes
    from ..bench.table import print_table
    from .sim import _print_table as print_sim_table

    console = Console(width=max(Console().width, 130))

    def show_sim(trace, rows) -> None:
        print_sim_table(trace, rows, SIM_HARDWARE, True)
        for note in sim_notes(trace, rows):
            print(note)
        console.rule(f"2. Live benchmark: first {args.layers} MoE layers, real expert weights, {args.dtype}")

    console.rule("1. Simulator: hit rate of each policy on the built-in trace (all 48 layers)")
    demo = run_demo(args.out, tokens=args.tokens, layers=args.layers, scale=args.scale, dtype=args.dtype,
                    device=args.device, threads=args.threads, on_sim=show_sim,
                    progress=lambda m: print(m, file=sys.stderr))
    print_table(demo.bench, console)
    print(summary(demo.bench["checks"]))
    console.rule("Verdict")
    print(demo.verdict)
    print(f"Plots and JSON in {args.out}/: {', '.join(FILES)}")
    return 0 if demo.bench["checks"]["ok"] else 1
