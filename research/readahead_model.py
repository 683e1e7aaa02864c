"""A random bench model whose router read-ahead guesses hold and whose tier hits stay high.

The router read-ahead (runtime/ggmltier.py ``Prefetch``) guesses layer l+1's experts from layer
l's MoE input; on the bench model's random weights the guesses are right 0.01-0.03 of the time
(docs/tiers.md). Trained models are reported to route so that they hold (Fate, arXiv
2502.12224: about 97%), because each layer adds little to the residual stream. Two knobs of
``bench_tiers.build_model``:

- ``update`` F: what each layer adds to the stream (small: guesses hold, but the stream is
  then each token's own embedding, and consecutive tokens share few experts);
- ``shared`` S: a direction shared by every token's embedding, S times a token's own norm
  (large: the tokens route alike, the tier hits more).

For each (F, S) this builds the model (kept in ``--dir``) and decodes ``--tokens`` sampled tokens
with a tier of ``--share`` % (no memory limit, one process each), then prints the decode's tier
hit rate, file bytes a token, and the guesses' precision (of the guessed experts missing from the
tier, the share the step then loaded: what ``Prefetch`` scores, read or not) and their accuracy
(of all the guessed experts, those the step routed to).

    PYTHONPATH=src .venv/bin/python research/readahead_model.py --grid 0.1,0 0.1,1 0.05,2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "src"))


def child(spec: dict) -> None:
    import torch

    import expertcache
    from bench_tiers import PROMPT
    from expertcache.runtime import ggmltier, tiered
    from expertcache.runtime.generate import report
    from expertcache.stats import DECODE

    torch.set_num_threads(2)
    model = expertcache.offload(spec["model"], device="cpu", baseline="resident", host_memory="tiered",
                                host_budget=f"{spec['share']}%")
    cache = model.expertcache
    if spec.get("read_ahead") is not None:
        cache.tier.ahead.min_precision = {"all": 0.0, "off": 2.0}[spec["read_ahead"]]
    # accuracy: of all guessed experts (missing from the tier or not), those the step routed to
    overlap = [0, 0]  # right, guessed
    guesses = {}  # layer -> the experts last guessed for it
    issue, start = ggmltier.Prefetch.issue, tiered.TieredStore.start

    def issue_(self, layer, experts):
        guesses[layer] = set(experts)
        return issue(self, layer, experts)

    def start_(self, layer, experts, phase, ahead=None):
        if layer in guesses and phase == DECODE:
            overlap[0] += len(guesses.pop(layer) & set(experts))
            overlap[1] += len(experts)
        return start(self, layer, experts, phase, ahead)
    ggmltier.Prefetch.issue = issue_
    tiered.TieredStore.start = start_
    cache.reset_stats()
    torch.manual_seed(0)
    model.generate(torch.tensor([PROMPT]), max_new_tokens=spec["tokens"], do_sample=True, temperature=1.0,
                   top_k=0, top_p=1.0)
    rep = report(model)
    steady = rep["decode_steady"]
    pre = cache.stats().pool["tier"]["prefetch"]
    print("RESULT " + json.dumps({
        "tok_s": steady["tokens"] / steady["seconds"], "ram_hits": steady.get("ram_hit_rate"),
        "mib_per_token": steady.get("file_bytes_per_token", 0) / 2**20,
        "precision": pre["guessed_right"] / max(pre["guessed_missing"], 1),
        "guessed_missing_per_token": pre["guessed_missing"] / max(spec["tokens"] - 1, 1),
        "accuracy": overlap[0] / max(overlap[1], 1), "used": pre["used"], "wasted": pre["wasted"]}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--dir", default="/tmp/tiers-bench")
    ap.add_argument("--grid", nargs="+", default=["1,0"], help="F,S pairs")
    ap.add_argument("--share", type=int, default=25)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--read-ahead", choices=["all", "off"], help="read every guess (min_precision 0) or none "
                    "(default: while the guesses' precision is at least 0.5)")
    args = ap.parse_args()
    if args.child:
        return child(json.loads(args.child))
    from bench_tiers import build_model, model_path

    print(f"{'F':>6} {'S':>5} {'tok/s':>7} {'RAM hits':>9} {'MiB/token':>10} {'precision':>10} "
          f"{'missing/tok':>12} {'accuracy':>9}")
    for pair in args.grid:
        update, shared = (float(x) for x in pair.split(","))
        path = model_path(Path(args.dir), update, shared)
        if not path.exists():
            build_model(path, update=update, shared=shared)
        spec = {"model": str(path), "share": args.share, "tokens": args.tokens, "read_ahead": args.read_ahead}
        proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)],
                              capture_output=True, text=True)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if not lines:
            print(f"{update:6g} {shared:5g} failed: {proc.stderr.splitlines()[-3:]}")
            continue
        r = json.loads(lines[-1][7:])
        print(f"{update:6g} {shared:5g} {r['tok_s']:7.1f} {r['ram_hits'] or 0:9.3f} {r['mib_per_token']:10.2f} "
              f"{r['precision']:10.2f} {r['guessed_missing_per_token']:12.2f} {r['accuracy']:9.2f}", flush=True)


if __name__ == "__main__":
    main()
