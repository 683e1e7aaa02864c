"""next-use window/horizon at one config on a (full) trace: spec 'window,horizon'."""
import sys
sys.path.insert(0, "research")
from replay import steps_of, replay

name, tokens, part, slots = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
steps, L, E, k = steps_of(name, tokens)
b = replay(steps, L, E, k, slots, part, "belady")[0]
for spec in sys.argv[5:]:
    w, h = spec.split(",")
    m, dt = replay(steps, L, E, k, slots, part, "next-use", ep={"window": float(w), "horizon": int(h)})
    print(spec, round(m / b, 3), f"{dt:.0f}s", flush=True)
