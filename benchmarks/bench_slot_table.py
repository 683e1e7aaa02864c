"""SlotTable bookkeeping speed: accesses per second with LRU, beside libCacheSim's
Python loop (one ``get`` per access) on the same accesses.

    .venv/bin/python benchmarks/bench_slot_table.py [--tokens 2000] [--json OUT]

Uses ../shared/traces/qwen3-30b-a3b-code.npz when present, else a synthetic
trace of the same shape (48 layers x 128 experts, top-8, skewed and sticky).
Goal (issue 2): >= 1.5 M accesses/s on one core.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

from expertcache import SlotTable

SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces" / "qwen3-30b-a3b-code.npz"


def synthetic(tokens: int, layers: int = 48, experts: int = 128, k: int = 8, seed: int = 0):
    """[L, T, k] expert ids: Zipf-ish popularity, about 45% reuse of the previous token's experts."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, experts + 1) ** 0.9
    out = np.empty((layers, tokens, k), dtype=np.int16)
    for layer in range(layers):
        p = rng.permutation(weights) / weights.sum()
        prev = rng.choice(experts, k, replace=False, p=p)
        for t in range(tokens):
            keep = prev[rng.random(k) < 0.45]
            fresh = [e for e in rng.choice(experts, 3 * k, p=p) if e not in keep]
            row = list(dict.fromkeys([*keep.tolist(), *fresh]))[:k]
            while len(row) < k:  # rare: top up with unused experts
                row.append(next(e for e in range(experts) if e not in row))
            out[layer, t] = prev = np.array(row)
    return out, "synthetic (48 x 128, top-8)"


def load(tokens: int, path: Path | None):
    path = path or (SHARED if SHARED.exists() else None)
    if path is None:
        return synthetic(tokens)
    from expertcache.trace import load_trace
    trace = load_trace(path)
    return trace.experts[:, :tokens], str(path.name)


class Clock:
    """Best-of-N CPU seconds (this process only: fair on a shared machine) and wall seconds."""

    def __init__(self) -> None:
        self.cpu = self.wall = float("inf")

    def __enter__(self):
        self._c, self._w = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.cpu = min(self.cpu, time.process_time() - self._c)
        self.wall = min(self.wall, time.perf_counter() - self._w)


def time_table(steps, layers, experts, slots, partition, k, repeat):
    clock, table = Clock(), None
    for _ in range(repeat):
        table = SlotTable(layers, experts, slots, eviction="lru", partition=partition, top_k=k)
        step = table.step
        with clock:
            for layer, ex in steps:
                step(layer, ex)
    return clock, table.stats().total()


def time_libcachesim(keys, slots, repeat, reuse: bool):
    """``reuse``: one Request whose id is reset per access (the fastest loop); else a new
    Request per access, as a straightforward loop is written."""
    import libcachesim
    Request = libcachesim.Request
    clock, hits = Clock(), 0
    for _ in range(repeat):
        cache = libcachesim.LRU(slots, hashpower=16)
        get = cache.get
        hits = 0
        if reuse:
            req = Request(obj_size=1)
            with clock:
                for key in keys:
                    req.obj_id = key
                    hits += get(req)
        else:
            with clock:
                for key in keys:
                    hits += get(Request(obj_size=1, obj_id=key))
    return clock, hits


def rates(clock: Clock, accesses: int) -> dict:
    return {"cpu_seconds": clock.cpu, "wall_seconds": clock.wall,
            "accesses_per_s": accesses / clock.cpu, "accesses_per_wall_s": accesses / clock.wall}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2000, help="tokens to replay (default 2000)")
    ap.add_argument("--trace", type=Path, help="a trace .npz (default: shared code trace or synthetic)")
    ap.add_argument("--fraction", type=float, default=0.125, help="slots as a share of all experts")
    ap.add_argument("--partition", choices=("global", "per-layer"), default="global")
    ap.add_argument("--repeat", type=int, default=3, help="best of N runs")
    ap.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    args = ap.parse_args(argv)
    if args.tokens < 1 or args.repeat < 1:
        ap.error("--tokens and --repeat must be at least 1")

    experts_arr, source = load(args.tokens, args.trace)
    L, T, k = experts_arr.shape
    E = max(128, int(experts_arr.max()) + 1)
    slots = max(k * (L if args.partition == "per-layer" else 1), round(args.fraction * L * E))
    # Steps token-major (token 0 layers 0..L-1, then token 1, ...), as the runtime sees them.
    steps = [(layer, experts_arr[layer, t].tolist()) for t in range(T) for layer in range(L)]
    keys = [layer * E + e + 1 for layer, ex in steps for e in ex]

    t_table, counts = time_table(steps, L, E, slots, args.partition, k, args.repeat)
    result = {
        "trace": source, "tokens": T, "layers": L, "experts": E, "top_k": k, "slots": slots,
        "partition": args.partition, "accesses": counts.accesses,
        "slot_table": {**rates(t_table, counts.accesses), "hit_rate": counts.hit_rate},
        "python": sys.version.split()[0], "machine": platform.machine(),
        "processor": platform.processor() or platform.platform(),
    }
    for label, reuse in (("libcachesim_python_loop", True), ("libcachesim_new_request_loop", False)):
        try:
            t_lcs, hits = time_libcachesim(keys, slots, args.repeat, reuse)
            result[label] = {**rates(t_lcs, len(keys)), "hit_rate": hits / len(keys)}
        except ImportError:
            result[label] = None

    print(f"trace {source}: {T} tokens x {L} layers, top-{k}, {slots} slots ({args.partition}), "
          f"{counts.accesses} accesses")
    print("                          M accesses/s: per CPU second (one core)  per wall second")
    row = result["slot_table"]
    print(f"SlotTable (lru)           {row['accesses_per_s'] / 1e6:6.2f}{row['accesses_per_wall_s'] / 1e6:26.2f}"
          f"   hit rate {counts.hit_rate:.4f}")
    for label, name in (("libcachesim_python_loop", "libCacheSim LRU, py loop"),
                        ("libcachesim_new_request_loop", "  same, new Request each")):
        lcs = result[label]
        if lcs is None:
            print("libCacheSim not installed (pip install libcachesim): no comparison")
            break
        print(f"{name:26}{lcs['accesses_per_s'] / 1e6:6.2f}{lcs['accesses_per_wall_s'] / 1e6:26.2f}"
              f"   hit rate {lcs['hit_rate']:.4f} (one key at a time, no step protection)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
