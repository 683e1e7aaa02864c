"""The simulator as a whole process, beside libCacheSim's C replay of the same accesses.

Three commands, each timed as a fresh process (wall seconds, median of ``--repeat``
rounds, the commands interleaved round by round so that load on a shared machine
falls on all of them alike):

1. ``expertcache sim TRACE --policy lru,belady --slots 768``: imports, trace loading,
   step keys, the LRU and Belady kernels, the table printed.
2. libCacheSim's LRU and Belady replaying the same accesses from its binary
   ``oracleGeneral`` file (written once, before the timings; one request at a time,
   so its hit rates differ slightly: no step protection). Goal: 1 no slower than 2.
3. ``expertcache --help``. Goal: under 0.3 s.

``--baseline SRC`` also times 1 and 3 with ``PYTHONPATH=SRC`` (e.g. an older
checkout's ``src``), side by side in the same rounds.

    .venv/bin/python benchmarks/bench_sim_e2e.py [--repeat 7] [--baseline /tmp/old/src]

Results (with the machine they ran on) go to benchmarks/results/sim_e2e.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "traces" / "qwen3-30b-a3b-code.npz"
CLI = "import sys; from expertcache.cli import main; sys.exit(main())"
LIBCACHESIM = """
import sys, libcachesim
for ref in (libcachesim.LRU, libcachesim.Belady):
    reader = libcachesim.TraceReader(sys.argv[1], libcachesim.TraceType.ORACLE_GENERAL_TRACE)
    print(ref.__name__, 1 - ref(int(sys.argv[2]), hashpower=16).process_trace(reader)[0])
"""


def wall(cmd: list[str], env: dict) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def write_accesses(trace_path: str, out: Path) -> int:
    sys.path.insert(0, str(ROOT / "tests"))
    from oracle_trace import flat_accesses, write_oracle_general

    from expertcache.sim import Prepared
    from expertcache.trace import load_trace
    seq = flat_accesses(Prepared(load_trace(trace_path)).keys)
    write_oracle_general(seq, out)
    return len(seq)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=str(TRACE))
    p.add_argument("--slots", type=int, default=768)
    p.add_argument("--repeat", type=int, default=7, help="rounds; medians are reported")
    p.add_argument("--baseline", metavar="SRC", help="also time this source tree (PYTHONPATH)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sim_e2e.json"))
    args = p.parse_args()
    if not Path(args.trace).exists():
        print(f"trace {args.trace} is absent (the shared traces live in ../shared/traces)",
              file=sys.stderr)
        return 2

    py, env = sys.executable, dict(os.environ)
    sim = [py, "-c", CLI, "sim", args.trace, "--policy", "lru,belady", "--slots", str(args.slots)]
    helpcmd = [py, "-c", CLI, "--help"]
    base_env = {**env, "PYTHONPATH": args.baseline} if args.baseline else None
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.oracleGeneral"
        accesses = write_accesses(args.trace, path)
        lcs = [py, "-c", LIBCACHESIM, str(path), str(args.slots)]
        runs = {"expertcache_sim": (sim, env), "libcachesim_lru_belady": (lcs, env),
                "expertcache_help": (helpcmd, env)}
        if base_env:
            runs["baseline_sim"] = (sim, base_env)
            runs["baseline_help"] = (helpcmd, base_env)
        for cmd, e in runs.values():  # warm the numba cache and the file cache
            wall(cmd, e)
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.repeat):
            for name, (cmd, e) in runs.items():
                times[name].append(wall(cmd, e))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    for name, ts in times.items():
        print(f"{name:24s} median {med[name]:6.3f} s   (min {min(ts):.3f}, max {max(ts):.3f})")
    ratio = med["expertcache_sim"] / med["libcachesim_lru_belady"]
    print(f"expertcache sim / libCacheSim: {ratio:.2f} (goal <= 1); --help "
          f"{med['expertcache_help']:.3f} s (goal < 0.3)")
    report = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "python": platform.python_version(),
                          "load_average_1m_at_start": os.getloadavg()[0]},
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "trace": Path(args.trace).name, "accesses": accesses, "slots": args.slots,
              "repeat": args.repeat, "baseline": args.baseline,
              "median_s": med, "all_s": times, "sim_over_libcachesim": ratio}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
