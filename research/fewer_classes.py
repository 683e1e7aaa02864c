"""Round two: does next-use need 10 count classes? Fewer classes = fewer looks per decision.

    .venv/bin/python research/fewer_classes.py code 1500
"""
import sys
sys.path.insert(0, "research")
from replay import steps_of, replay
import expertcache.policies.next_use as nu

VARIANTS = {"10 (shipped)": nu._EDGES, "6 x2": (2.0, 4.0, 8.0, 16.0, 32.0),
            "6 x2 from 1.5": (1.5, 3.0, 6.0, 12.0, 24.0), "4 x4": (2.0, 8.0, 24.0)}
name, tokens = sys.argv[1], int(sys.argv[2])
steps, L, E, k = steps_of(name, tokens)
configs = [(p, s) for p in ("global", "per-layer") for s in (768, 1536)]
base = {c: replay(steps, L, E, k, c[1], c[0], "belady")[0] for c in configs}
for label, edges in VARIANTS.items():
    nu._EDGES, nu._NCLASS = edges, len(edges) + 1
    r = [replay(steps, L, E, k, c[1], c[0], "next-use", ep={"window": 64.0, "horizon": 4})[0] / base[c] for c in configs]
    print(f"{label:14s}", " ".join(f"{x:.3f}" for x in r), f"avg {sum(r)/4:.3f}", flush=True)
