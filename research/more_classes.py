"""Round two: more count classes for the re-tuned window (128 passes lets counts reach ~128,
the shipped edges stop at 24). `base`: shipped edges; `ext`: 32, 48, 64 added (13 classes).
Result: code 1.608 -> 1.609, general 1.666 -> 1.667: no gain, ten classes kept.

    .venv/bin/python research/more_classes.py base; .venv/bin/python research/more_classes.py ext
"""
import sys, numpy as np, importlib.util
sys.path.insert(0, "research")
spec = importlib.util.spec_from_file_location("qo", "research/quantised_odds.py")
qo = importlib.util.module_from_spec(spec); spec.loader.exec_module(qo)
EXT = sys.argv[1] == "ext"
if EXT:
    e = (1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0, 64.0)
    qo._NCLASS = len(e) + 1; qo.EDGES = np.array(e)
from expertcache.policies.registry import make_eviction
from expertcache.sim.replay import Prepared, replay
from expertcache.trace import load_trace
for name in ("code", "general"):
    prep = Prepared(load_trace(f"../shared/traces/qwen3-30b-a3b-{name}.npz"))
    r = []
    for part in ("global", "per-layer"):
        for slots in (768, 1536):
            parts = 1 if part == "global" else prep.L
            cap = slots if part == "global" else slots // prep.L
            b = replay(prep, "belady", slots, part).misses
            pol = make_eviction("next-use", cap)
            c = qo._replay(prep.keys, prep.phases, prep.L, prep.E, parts, cap, float(pol.window), int(pol.horizon), 512, 1 << 16, qo.EDGES, 0.0)
            r.append(int(c[:, :, 2].sum()) / b)
    print(sys.argv[1], name, " ".join(f"{x:.3f}" for x in r), f"avg {sum(r)/4:.3f}", flush=True)
