"""Round two: next-use's (window, horizon) pairs on every trace, averaged over the
configurations benchmarks/policy_research.py reports (numba kernel; a minute or two).

    .venv/bin/python research/horizon_general.py                 # window 64, horizon 1, 2, 4
    .venv/bin/python research/horizon_general.py 64,4 128,2 code  # chosen pairs, chosen traces
"""
import sys
sys.path.insert(0, "benchmarks")
from policy_research import CONFIGS, load, slots_of
from expertcache.sim.replay import Prepared, replay

TRACES = ["code", "general", "phone"] + [f"synth:{p}:2000" for p in
                                         ("qwen3-30b-a3b", "gpt-oss-120b", "gpt-oss-20b", "olmoe", "mixtral-8x7b")]
SETTINGS = [tuple(map(float, a.split(","))) for a in sys.argv[1:] if "," in a] or [
    (64.0, 1), (64.0, 2), (64.0, 4)]   # window,horizon pairs as arguments, e.g. 64,4 128,2
for name in [a for a in sys.argv[1:] if "," not in a] or TRACES:
    prep = Prepared(load(name, 0))
    rows = []
    for part, frac in CONFIGS:
        slots = slots_of(prep.trace, frac)
        if part == "per-layer" and slots // prep.L <= prep.trace.top_k:
            continue
        b = replay(prep, "belady", slots, part).misses
        rows.append([replay(prep, "lru", slots, part).misses / b] +
                    [replay(prep, "next-use", slots, part,
                            eviction_params={"window": w, "horizon": int(h)}).misses / b
                     for w, h in SETTINGS])
        print(f"  {name} {part} {frac}", " ".join(f"{x:.3f}" for x in rows[-1]), flush=True)
    avg = [sum(r[i] for r in rows) / len(rows) for i in range(len(SETTINGS) + 1)]
    print(f"{name:26s} lru {avg[0]:.3f}", " ".join(f"w{w:g}h{h:g} {x:.3f}" for (w, h), x in zip(SETTINGS, avg[1:])),
          flush=True)
