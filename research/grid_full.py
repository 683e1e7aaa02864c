"""Grid of next-use (window, horizon) over the 4 configurations of a trace (0 tokens = all)."""
import sys
sys.path.insert(0, "research")
from replay import steps_of, replay

name, tokens = sys.argv[1], int(sys.argv[2])
steps, L, E, k = steps_of(name, tokens)
configs = [(p, s) for p in ("global", "per-layer") for s in (768, 1536)]
base = {c: replay(steps, L, E, k, c[1], c[0], "belady")[0] for c in configs}
for spec in sys.argv[3:]:
    w, h = spec.split(",")
    r = [replay(steps, L, E, k, s, p, "next-use", ep={"window": float(w), "horizon": int(h)})[0]
         / base[(p, s)] for p, s in configs]
    print(f"{spec:10s}", " ".join(f"{x:.3f}" for x in r), f"avg {sum(r) / 4:.3f}", flush=True)
