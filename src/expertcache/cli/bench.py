"""``expertcache bench``: decode time per token with real expert weights, strategy by strategy.

Routing is replayed from ``--trace FILE`` or a synthetic ``--preset``; expert weights
(Qwen3-style SwiGLU, the preset's dimensions times ``--scale``) live in host memory
and the runtime's slot pool on the device. Strategies side by side: resident,
copy-every-pass, cpu, the cache for every ``--policy`` x ``--slots``, and belady.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .paths import check_output


def add_parser(sub) -> None:
    from ..config import PARTITIONS

    p = sub.add_parser("bench", help="decode benchmark: baselines vs the cache on real expert weights",
                       description=__doc__)
    p.add_argument("--trace", help="routing trace .npz to replay (default: synthetic)")
    p.add_argument("--preset", help="model shape: qwen3-30b-a3b, gpt-oss-120b, mixtral-8x7b, olmoe, ... "
                                    "(alone: a synthetic trace of it)")
    p.add_argument("--scale", type=float, default=0.125,
                   help="multiplies hidden and expert FF sizes (1 = real size; default 0.125)")
    p.add_argument("--layers", type=int, help="run only the first N MoE layers")
    p.add_argument("--tokens", type=int, default=256, help="tokens replayed (default 256)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--policy", help="cache policies, comma separated, e.g. lru,slru+second-hit,"
                                    "slru:protected=0.5 (parameters: NAME:KEY=VALUE, see expertcache policies) "
                                    "(default: 'default' if registered, else lru)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--slots", help="total slots, comma separated (e.g. 256,512)")
    size.add_argument("--fraction", help="share of all L x E experts in slots (default 0.125,0.25,0.5)")
    p.add_argument("--partition", default="global", choices=PARTITIONS)
    p.add_argument("--no-belady", action="store_true", help="skip the belady (offline optimum) runs")
    p.add_argument("--baselines", default="resident,copy-every-pass,cpu",
                   help="baselines to run, comma separated, or 'none' (default: all three; "
                        "resident needs a second copy of every expert in the pool)")
    p.add_argument("--device", default="auto", help="auto (cuda if present), cpu or cuda")
    p.add_argument("--hardware", default="calibrate",
                   help="cost-model profile for predictions: 'calibrate' (measure here, default), "
                        "'none', a preset (pcie4-consumer, ...) or a JSON from 'expertcache probe'")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--clock", default="auto", choices=("auto", "wall", "cpu"),
                   help="timer: wall, or the thread's CPU time (robust on a shared CPU; auto picks "
                        "it with --device cpu --threads 1)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights, hidden vectors, synthetic traces")
    p.add_argument("--json", metavar="OUT", help="write results as JSON")
    p.add_argument("--plot", metavar="OUT.png", help="draw steady tok/s against slots per strategy")
    p.set_defaults(func=run)


def run(args) -> int:
    check_output(args.json, "--json")
    check_output(args.plot, "--plot")
    from ..bench.api import FRACTIONS, run_bench
    from ..bench.checks import summary
    from ..bench.plot import plot_tok_s, title
    from ..bench.report import verdict
    from ..bench.table import print_table

    doc = run_bench(trace=args.trace, preset=args.preset, tokens=args.tokens, layers=args.layers,
                    scale=args.scale, dtype=args.dtype,
                    policies=_list(args.policy, str, "--policy") if args.policy else None,
                    slots=_list(args.slots, int, "--slots") if args.slots else None,
                    fractions=_list(args.fraction, float, "--fraction") if args.fraction else FRACTIONS,
                    partition=args.partition, baselines=_baselines(args.baselines),
                    belady=not args.no_belady, device=args.device,
                    hardware=None if args.hardware == "none" else args.hardware, threads=args.threads,
                    clock=args.clock, seed=args.seed, progress=lambda m: print(m, file=sys.stderr))
    print_table(doc)
    print(f"planner: {PLANNER}")
    print(summary(doc["checks"]))
    print(verdict(doc["results"]))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        plot_tok_s(doc["results"], args.plot, title=title(doc))
        print(f"wrote {args.plot}")
    return 0 if doc["checks"]["ok"] else 1  # a bench whose figures do not add up must not pass


# The bench's cache strategies run the host planner (bench/strategies.py configs).
PLANNER = ("host (each step's routing is read back and planned at once, as generate --planner host "
           "runs; the bench does not time planner 'device': run generate --planner device for it)")


def _baselines(text: str) -> list[str]:
    return [] if text.strip() == "none" else _list(text, str, "--baselines")


def _list(text: str, kind, flag: str) -> list:
    try:
        values = [kind(x.strip()) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated {kind.__name__}s, got {text!r}") from None
    if not values:
        raise ValueError(f"{flag} is empty")
    return values
