"""Where a decode token's time goes in the tier's segmented graph (runtime/ggmltier.py).

Loads the bench model (benchmarks/bench_tiers.py builds it) with ``host_memory='tiered'`` in
this process (no memory limit), decodes ``--tokens`` sampled tokens, and times, per decode
token, by wrapping the methods (nothing in the library changes):

- each ggml segment call (``_run``: segment 0; a layer without reads, A and the rest of the
  layer; with reads, the hits' pairs beside them, then the read experts' pairs and the rest of
  the layer),
- the tier's step start (``_start``: the table, read submits, the read-ahead's issue),
- the wait for reads (``TieredStore.finish``), ``_point`` (rows into ``rid``),
- inside ``_start``: the reads started before the table's step (``_read_early``), the table's
  step, the reads planned, the file check, ``io_submit``
  (kernel AIO, runtime/kernelaio.py); inside ``finish``: each payload landed (copied or
  repacked into its row),
- with reader threads instead (``EXPERTCACHE_AIO=0``), each read (``DirectFile.read_into``):
  queue time (submit -> start on a reader thread) and its own time, per part (one expert is
  one read per part),
- the rest: Python between segments and around the forward (sampling, transformers).

    flock /tmp/bench.lock env PYTHONPATH=src python benchmarks/profile_tier.py --dir /tmp/tiers-bench

``--no-prefetch`` turns the read-ahead off; ``--reference`` profiles the all-in-RAM graph.
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/tiers-bench")
    ap.add_argument("--model", help="a GGUF (default: the bench's default model in --dir)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--share", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-prefetch", action="store_true")
    ap.add_argument("--reference", action="store_true", help="the all-in-RAM graph (host_memory='copy')")
    ap.add_argument("--repack", default="auto", help="cpu_repack of the reference")
    args = ap.parse_args()

    import torch

    import expertcache
    from expertcache.runtime import directio, ggmltier, kernelaio, tiered
    from expertcache.runtime.generate import report

    torch.set_num_threads(args.threads)
    now = time.perf_counter
    acc = collections.defaultdict(float)   # name -> seconds (decode tokens only)
    cnt = collections.Counter()
    on = [False]

    def timed(cls, name, key=None):
        fn = getattr(cls, name)

        def wrap(*a, **kw):
            if not on[0]:
                return fn(*a, **kw)
            t = now()
            try:
                return fn(*a, **kw)
            finally:
                k = key(a) if key else name
                acc[k] += now() - t
                cnt[k] += 1
        setattr(cls, name, wrap)

    def seg_kind(a):
        self, i = a[0], a[1]
        if self.tokens != 1:
            return "run: prefill"
        if i == 0:
            return "run: segment 0 (embedding .. layer 0 router)"
        if i in self._a_rest:
            return "run: A + rest of layer (no reads, or every expert read)"
        if any(i in segs for segs in self._sub_rest):
            return "run: the read experts' pairs + rest of layer"
        return "run: the hits' pairs beside the reads"

    submitted = {}   # id(dst) -> submit time
    reads = []       # (queue seconds, read seconds, nbytes)
    lock = threading.Lock()
    if not args.reference:
        G = ggmltier._TierStepGraph
        timed(G, "_run", seg_kind)
        timed(G, "_start", lambda a: "python: _start (table, submits, read-ahead issue)")
        timed(G, "_point", lambda a: "python: _point")
        timed(tiered.TieredStore, "finish", lambda a: "wait: TieredStore.finish")
        timed(ggmltier.Prefetch, "issue", lambda a: "python: Prefetch.issue (in _start)")
        timed(ggmltier.Prefetch, "drain", lambda a: "wait: Prefetch.drain")
        timed(ggmltier.Prefetch, "take", lambda a: "python: Prefetch.take (read ahead -> row, in _start)")
        timed(tiered.TieredStore, "put", lambda a: "python: a part copied/repacked into its row (put)")
        timed(G, "_compute", lambda a: "forward: _compute (whole graph)")
        timed(tiered.SlotTable, "step", lambda a: "python: table step (in _start)")
        timed(tiered.TieredStore, "_fill", lambda a: "python: reads planned (in _start)")
        timed(tiered.TieredStore, "_read_early", lambda a: "python: reads started before the table (in _start)")
        timed(directio.DirectFile, "check", lambda a: "python: file check (in _start)")
        timed(kernelaio.AioPool, "submit", lambda a: "python: io_submit (in _start)")
        timed(kernelaio.AioPool, "_land", lambda a: "wait: payload copied/repacked (in finish)")
        sub = directio.ReadPool.submit

        def submit(self, jobs, *rest):
            if on[0]:
                t = now()
                for j in jobs:
                    submitted[id(j[1])] = t
            return sub(self, jobs, *rest)
        directio.ReadPool.submit = submit
        rd = directio.DirectFile.read_into

        def read_into(self, dst, offset, what, put=None):
            t = now()
            out = rd(self, dst, offset, what, put)
            if on[0]:
                with lock:
                    reads.append((t - submitted.pop(id(dst), t), now() - t, dst.nbytes))
            return out
        directio.DirectFile.read_into = read_into

    settings = dict(host_memory="copy", cpu_repack=args.repack) if args.reference else dict(host_memory="tiered",
                                                                     host_budget=f"{args.share}%")
    model = expertcache.offload(args.model or str(Path(args.dir) / "qwen3moe-q4_0-tiers.gguf"), device="cpu",
                                baseline="resident", **settings)
    cache = model.expertcache
    if args.no_prefetch and not args.reference:
        cache.tier.ahead.min_precision = 2.0  # never reads ahead (still scores its guesses)
    ids = torch.tensor([[5, 9, 77, 120, 3, 44, 200, 17]])
    torch.manual_seed(0)
    model.generate(ids, max_new_tokens=4, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)  # warm
    cache.reset_stats()
    prefills = [0.0]
    fwd = model.forward

    def forward(*a, **kw):
        x = kw.get("input_ids", a[0] if a else None)
        on[0] = x is not None and x.shape[1] == 1
        t = now()
        out = fwd(*a, **kw)
        if on[0]:
            acc["forward: model.forward (decode)"] += now() - t
            cnt["forward: model.forward (decode)"] += 1
        on[0] = False
        return out
    model.forward = forward
    torch.manual_seed(0)
    t0 = now()
    model.generate(ids, max_new_tokens=args.tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    wall = now() - t0
    rep = report(model)
    dec = [rep[f"decode_{p}"] for p in ("cold", "warm", "steady")]
    n, s = sum(p["tokens"] for p in dec), sum(p["seconds"] for p in dec)
    print(f"decode {n} tokens in {s:.3f} s: {n / s:.2f} tok/s, {1e3 * s / n:.2f} ms/token (generate wall {wall:.3f} s)")
    per = cnt["forward: model.forward (decode)"] or 1
    print(f"per decode token ({per} timed forwards):")
    for k in sorted(acc, key=lambda k: (k.split(":")[0], -acc[k])):
        print(f"  {k:58s} {1e3 * acc[k] / per:7.3f} ms  ({cnt[k] / per:5.1f} calls)")
    if reads:
        import numpy as np
        q = np.array([r[0] for r in reads]) * 1e3
        r = np.array([r[1] for r in reads]) * 1e3
        b = sum(x[2] for x in reads)
        print(f"reads: {len(reads)} ({len(reads) / per:.1f} a token), {b / per / 2**20:.2f} MiB a token; "
              f"queue ms median {np.median(q):.3f} p90 {np.percentile(q, 90):.3f}; read+copy ms median "
              f"{np.median(r):.3f} p90 {np.percentile(r, 90):.3f}; sum of read time {r.sum() / per:.2f} ms a token")
    if not args.reference:
        print(cache.tier.summary_line())


if __name__ == "__main__":
    main()
