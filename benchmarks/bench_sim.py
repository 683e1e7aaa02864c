"""Simulator speed on the shared 8000-token Qwen3 trace (3.07 M accesses).

1. LRU and Belady single runs, side by side: our numba kernels, the SlotTable
   path they are tested equal to, and libCacheSim's C replay of the same
   accesses from its oracleGeneral trace file (one request at a time, so its
   hit rates differ slightly: no step protection). Goal: not slower than
   libCacheSim.
2. A sweep of 8 policies x 8 sizes (global pool). Goal: under 60 s on 2 cores.

    .venv/bin/python benchmarks/bench_sim.py [--tokens N] [--skip-table] [--out FILE]

Results (with the machine they ran on) go to benchmarks/results/sim.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "traces" / "qwen3-30b-a3b-code.npz"
POLICIES = "lru,fifo,belady,lru+second-hit,slru,arc,s3fifo,lfu"
FRACTIONS = (1 / 32, 1 / 16, 1 / 8, 3 / 16, 1 / 4, 3 / 8, 1 / 2, 3 / 4)


def best_of(fn, repeat: int = 3) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def single_runs(prep, slots: int, skip_table: bool) -> list[dict]:
    import libcachesim

    from expertcache.sim import replay
    sys.path.insert(0, str(ROOT / "tests"))  # the oracleGeneral writer is a test helper
    from oracle_trace import flat_accesses, write_oracle_general

    seq = flat_accesses(prep.keys)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = write_oracle_general(seq, Path(tmp) / "trace.oracleGeneral")
        for policy, ref in (("lru", libcachesim.LRU), ("belady", libcachesim.Belady)):
            replay(prep, policy, slots)  # compile / load the kernel first
            t_fast, fast = best_of(lambda: replay(prep, policy, slots))

            def c_replay():
                reader = libcachesim.TraceReader(str(path), libcachesim.TraceType.ORACLE_GENERAL_TRACE)
                return ref(slots, hashpower=16).process_trace(reader)[0]
            t_lcs, miss_ratio = best_of(c_replay)
            row = {"policy": policy, "slots": slots, "accesses": len(seq),
                   "fast_s": t_fast, "fast_engine": fast.engine, "fast_hit_rate": fast.hit_rate,
                   "libcachesim_s": t_lcs, "libcachesim_hit_rate": 1 - miss_ratio,
                   "speedup_vs_libcachesim": t_lcs / t_fast}
            if not skip_table:
                t_table, table = best_of(lambda: replay(prep, policy, slots, engine="table"), 1)
                assert table.stats.to_dict() == fast.stats.to_dict(), "kernel != SlotTable"
                row["table_s"] = t_table
            rows.append(row)
            print(f"{policy:7s} {slots} slots: kernel {t_fast:6.3f} s ({len(seq) / t_fast / 1e6:5.1f} M/s)"
                  + (f", SlotTable {row['table_s']:6.2f} s" if "table_s" in row else "")
                  + f", libCacheSim file replay {t_lcs:6.3f} s ({len(seq) / t_lcs / 1e6:5.1f} M/s)"
                  f"; kernel is {row['speedup_vs_libcachesim']:.2f}x libCacheSim"
                  f" (hit rate {fast.hit_rate:.4f} vs {1 - miss_ratio:.4f} without step protection)")
    return rows


def sweep_run(prep, policies: list[str], workers: int) -> dict:
    from expertcache.sim.mrc import sweep
    from expertcache.sim.replay import slots_for_fraction

    sizes = [slots_for_fraction(prep.trace, f) for f in FRACTIONS]
    t = time.perf_counter()
    results = sweep(prep, policies, sizes, workers=workers,
                    progress=lambda d, n: print(f"\r  sweep {d}/{n} jobs", end="", file=sys.stderr))
    wall = time.perf_counter() - t
    print(file=sys.stderr)
    engines = {r.label: r.engine for r in results}
    print(f"sweep {len(policies)} policies x {len(sizes)} sizes: {wall:.1f} s wall "
          f"with {workers} workers; engines: {engines}")
    for label in dict.fromkeys(r.label for r in results):
        rates = " ".join(f"{r.hit_rate:.3f}" for r in results if r.label == label)
        print(f"  {label:16s} {rates}")
    return {"policies": policies, "slots": sizes, "workers": workers, "wall_s": wall,
            "engines": engines,
            "hit_rates": {r.label: [x.hit_rate for x in results if x.label == r.label]
                          for r in results}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=str(TRACE))
    p.add_argument("--tokens", type=int, help="only the first N tokens")
    p.add_argument("--slots", type=int, default=768, help="size of the single runs")
    p.add_argument("--policies", default=POLICIES)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--skip-table", action="store_true", help="skip the slow SlotTable single runs")
    p.add_argument("--skip-sweep", action="store_true")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sim.json"))
    args = p.parse_args()

    from expertcache.sim import Prepared
    from expertcache.trace import load_trace

    if not Path(args.trace).exists():
        print(f"trace {args.trace} is absent (the shared traces live in ../shared/traces)", file=sys.stderr)
        return 2
    trace = load_trace(args.trace)
    if args.tokens:
        trace = trace.slice_tokens(args.tokens)
    prep = Prepared(trace)
    t = time.perf_counter()
    prep.keys, prep.future_arrays, prep.phases  # noqa: B018 (build once, outside the timings)
    print(f"{args.trace}: {trace.num_layers} x {trace.num_experts}, top-{trace.top_k}, "
          f"{trace.num_tokens} tokens; prepared in {time.perf_counter() - t:.2f} s")
    import numba
    report = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "python": platform.python_version(), "numba": numba.__version__,
                          # other jobs on the machine slow every figure: record how busy it was
                          "load_average_1m_at_start": os.getloadavg()[0]},
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "trace": Path(args.trace).name, "tokens": trace.num_tokens,
              "single": single_runs(prep, args.slots, args.skip_table)}
    if not args.skip_sweep:
        report["sweep"] = sweep_run(prep, args.policies.split(","), args.workers)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
