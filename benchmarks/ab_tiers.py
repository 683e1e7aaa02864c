"""The tier's decode in this tree against another tree's, interleaved in one cgroup limit.

A change to the tier's decode is often smaller than what the machine's speed and the disk's
drift between two runs of ``bench_tiers.py``; here both trees run in the same rounds, in
alternating order, each round between two all-in-RAM reference runs (this tree's). The other
tree is a checkout of the code to compare with, e.g.

    git archive acb8e38 src benchmarks tests | tar -x -C /tmp/base
    flock /tmp/bench.lock python benchmarks/ab_tiers.py --base /tmp/base --rounds 5

Each run is ``bench_tiers.py``'s child of its own tree (its own process, in the cgroup, the page
cache dropped first): the bench model it builds (``--dir``), 32 sampled tokens, tokens checked
against the reference's. Prints each round's tok/s, the share of the all-in-RAM speed and the
ratio this / base; ``--json`` saves them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the other tree (holding benchmarks/bench_tiers.py and src)")
    ap.add_argument("--dir", default="/tmp/tiers-bench", help="where bench_tiers.py built its model")
    ap.add_argument("--model", help="a GGUF built by bench_tiers.py (default: its default model in --dir)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--share", type=int, default=25, help="the tier's budget, %% of the experts")
    ap.add_argument("--limit", default="871MiB", help="the cgroup limit of the tier runs")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    other = Path(args.base) / "benchmarks" / "bench_tiers.py"
    if not other.exists():
        raise SystemExit(f"{other} not found: --base must be a tree with benchmarks/bench_tiers.py and src "
                         "(git archive REF src benchmarks tests | tar -x -C DIR)")
    this, base = _load("bench_this", HERE / "bench_tiers.py"), _load("bench_base", other)
    from expertcache.sizes import parse_size

    model = Path(args.model) if args.model else Path(args.dir) / "qwen3moe-q4_0-tiers.gguf"
    if not model.exists():
        raise SystemExit(f"{model} not found: run benchmarks/bench_tiers.py --dir {args.dir} once to build it")
    cgroup, text = this.make_cgroup("expertcache-tiers", parse_size(args.limit))
    print(text, flush=True)
    tier = this._tier(args.share)
    rounds = []
    for rnd in range(args.rounds):
        refs = [this.run(model, "reference", dict(host_memory="copy"), args.tokens, args.threads, None)]
        order = [("this", this), ("base", base)] if rnd % 2 == 0 else [("base", base), ("this", this)]
        got = {}
        for name, module in order:
            r = module.run(model, name, tier, args.tokens, args.threads, cgroup)
            if "error" in r:
                raise SystemExit(f"round {rnd + 1}, {name}: {r['error']}")
            if r["tokens"] != refs[0]["tokens"]:
                raise SystemExit(f"round {rnd + 1}, {name}: tokens differ from the all-in-RAM run's")
            got[name] = r["tok_s"]
        refs.append(this.run(model, "reference", dict(host_memory="copy"), args.tokens, args.threads, None))
        ram = statistics.mean(r["tok_s"] for r in refs)
        row = {"round": rnd + 1, "all_in_ram": [r["tok_s"] for r in refs], **got,
               "this_of_ram": got["this"] / ram, "base_of_ram": got["base"] / ram, "this_over_base": got["this"] / got["base"]}
        rounds.append(row)
        print(f"round {rnd + 1}: all in RAM {refs[0]['tok_s']:.2f} / {refs[1]['tok_s']:.2f} tok/s; this "
              f"{got['this']:.2f} ({row['this_of_ram']:.2f} of it), base {got['base']:.2f} "
              f"({row['base_of_ram']:.2f}); this / base {row['this_over_base']:.3f}", flush=True)
    ratios = [r["this_over_base"] for r in rounds]
    print(f"this / base: median {statistics.median(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"base": args.base, "model": str(model), "share": args.share,
                                               "limit": args.limit, "tokens": args.tokens,
                                               "machine": this._machine(), "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
