"""Round two: next-use's window x horizon per configuration on full traces, through the numba
kernel (policies/kernels/next_use.py; ~1 s a replay). Does the best horizon depend on the capacity?

    .venv/bin/python research/grid_kernel.py code
"""
import sys
from expertcache.sim.replay import Prepared, replay
from expertcache.trace import load_trace

name = sys.argv[1]
prep = Prepared(load_trace(f"../shared/traces/qwen3-30b-a3b-{name}.npz"))
configs = [(p, s) for p in ("global", "per-layer") for s in (768, 1536)]
base = {c: replay(prep, "belady", c[1], c[0]).misses for c in configs}
print("window horizon  g768  g1536  p768  p1536  avg")
for window in (16.0, 32.0, 64.0, 128.0):
    for horizon in (1, 2, 3, 4, 6, 8):
        ep = {"window": window, "horizon": horizon}
        r = [replay(prep, "next-use", c[1], c[0], eviction_params=ep).misses / base[c] for c in configs]
        print(f"{window:6.0f} {horizon:7d}", " ".join(f"{x:.3f}" for x in r), f"{sum(r)/4:.3f}", flush=True)
