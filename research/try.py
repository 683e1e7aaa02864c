"""Quick: ratio to Belady for registered policy specs on the first N tokens."""
import sys, json
from replay import steps_of, replay
name, tokens = sys.argv[1], int(sys.argv[2])
steps, L, E, k = steps_of(name, tokens)
configs = [(p, s) for p in ("global", "per-layer") for s in (768, 1536)]
base = {c: replay(steps, L, E, k, c[1], c[0], "belady")[0] for c in configs}
for spec in sys.argv[3:]:
    ev, _, rest = spec.partition(":")
    params = json.loads(rest) if rest else {}
    ev, _, ad = ev.partition("+")
    res = [replay(steps, L, E, k, c[1], c[0], ev, ad or "always", ep=params) for c in configs]
    r = [m / base[c] for (m, _), c in zip(res, configs)]
    print(f"{spec:45s}", " ".join(f"{x:.3f}" for x in r), f"avg {sum(r)/len(r):.3f}",
          f"{sum(t for _, t in res):.1f}s", flush=True)
