"""The cost of running the policy a forward behind the device (planner='device'), on real traces.

For each shared Qwen3-30B-A3B trace (../shared/traces: 48 MoE layers, 128 experts, top-8)
and batch B: B = 1 replays the trace token by token; B = 4 cuts it into 4 equal streams and
interleaves them, so each forward (a row of 48 steps) needs the union of 4 tokens' experts
per layer (a grouped trace, as an engine batching 4 requests plans it). Each policy and size
replays at lag 0 (the host planner), lag 1 and lag 2 (``sim/lag.py``), with staging rows
shared by all layers (blocks 1) and, at lag 1, a staging block per layer (blocks 48).
Reported: decode hit rate and experts copied from the host per forward.

    .venv/bin/python benchmarks/bench_lag.py [--tokens 8000] [--policies lru,default]

Writes benchmarks/results/bench_lag.json. The same figures, one at a time:
``expertcache sim TRACE --policy lru --slots 768 --lag 0,1,2 [--lag-blocks 48]``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from expertcache.sim.lag import lag_replay
from expertcache.sim.replay import Prepared
from expertcache.trace.format import Trace, load_trace

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
RESULTS = Path(__file__).resolve().parent / "results" / "bench_lag.json"


def interleaved(trace: Trace, batch: int) -> Trace:
    """``batch`` equal streams of ``trace`` decoded together: a grouped trace of batch-token steps."""
    n = trace.num_tokens // batch
    streams = trace.experts[:, :n * batch].reshape(trace.num_layers, batch, n, trace.top_k)
    experts = streams.transpose(0, 2, 1, 3).reshape(trace.num_layers, n * batch, trace.top_k)
    meta = {**trace.meta, "prefill_steps": "grouped", "step_tokens": [batch] * n}
    return Trace(np.ascontiguousarray(experts), meta)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--policies", default="lru,default")
    ap.add_argument("--fractions", default="0.125,0.25")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--json", default=str(RESULTS))
    args = ap.parse_args()
    rows = []
    for name in ("code", "general"):
        base = load_trace(TRACES / f"qwen3-30b-a3b-{name}.npz").slice_tokens(args.tokens)
        total = base.num_layers * base.num_experts
        for batch in (int(b) for b in args.batches.split(",")):
            prep = Prepared(base if batch == 1 else interleaved(base, batch))
            forwards = len(prep.step_lists)
            for policy in args.policies.split(","):
                for fraction in (float(f) for f in args.fractions.split(",")):
                    slots = round(fraction * total)
                    for lag, blocks in ((0, 1), (1, 1), (1, base.num_layers), (2, 1)):
                        t = time.perf_counter()
                        r = lag_replay(prep, policy, slots, lag=lag, blocks=blocks)
                        row = {"trace": name, "batch": batch, "forwards": forwards, "blocks": blocks,
                               **r.to_dict(), "copies_per_forward": r.host_copies / forwards,
                               "seconds": time.perf_counter() - t}
                        rows.append(row)
                        print(f"{name:8} B={batch} {r.label:>20} {slots:5} lag {lag} blocks {blocks:2}: "
                              f"hit {row['decode_hit_rate']:.4f}  copies/forward {row['copies_per_forward']:7.1f}",
                              flush=True)
    Path(args.json).write_text(json.dumps({"benchmark": "bench_lag", "tokens": args.tokens,
                                           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                           "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
