"""Round two: next-use with the layer phase as tie-break, looking at the `look` oldest keys of
each class (not a scan). The phase needs no model shape: a key's layer comes round again
(last - now) mod period steps from now (token-major steps, period = steps per pass).

    .venv/bin/python research/phase_look.py code 1000 1 2 4 8
"""
import sys
sys.path.insert(0, "research")
from replay import steps_of, replay
from expertcache.policies.next_use import NextUse, _GAPS
from expertcache.policies.registry import register


@register
class PhaseLook(NextUse):
    name = "next-use-phase"
    params = {"window": 64.0, "horizon": 4, "look": 4, "mode": 0}

    def __init__(self, capacity, window=64.0, horizon=4, look=4, mode=0):
        super().__init__(capacity, window, horizon)
        self.look, self.mode = look, mode

    def victim(self, protected):
        period, now, look = self._period or 1, self._now, self.look
        best, best_rank = None, None
        for members, score in zip(self._classes, self._score):
            n = 0
            for key, last in members.items():
                if key in protected:
                    continue
                age = (now - last) // period
                odds = score[age] if age < _GAPS else score[_GAPS]
                d = (last - now) % period or period   # steps until its layer comes round
                if self.mode == 0:
                    rank = (odds, -d, last)
                else:   # odds scaled: a later chance is worth less (one pass ~ factor mode/100)
                    rank = (odds * (1 - self.mode / 100 * d / period), last)
                if best_rank is None or rank < best_rank:
                    best, best_rank = key, rank
                n += 1
                if n >= look:
                    break
        return best


if __name__ == "__main__":
    name, tokens = sys.argv[1], int(sys.argv[2])
    steps, L, E, k = steps_of(name, tokens)
    configs = [("global", 768), ("global", 1536)]
    base = {c: replay(steps, L, E, k, c[1], c[0], "belady")[0] for c in configs}
    for arg in ["base"] + sys.argv[3:]:
        if arg == "base":
            ev, ep = "next-use", {"window": 64.0, "horizon": 4}   # round one's setting
        else:
            look, _, mode = arg.partition("/")
            ev, ep = "next-use-phase", {"look": int(look), "mode": int(mode or 0)}
        r = [replay(steps, L, E, k, c[1], c[0], ev, ep=ep)[0] / base[c] for c in configs]
        print(arg, " ".join(f"{x:.3f}" for x in r), f"avg {sum(r)/2:.3f}", flush=True)
