"""Next-use: evict the key least likely to be used again soon, as learned online.

Routing does not depend on what the cache holds, so the reuse pattern of keys
can be learned from the access stream itself. Each key carries two numbers set
at its last use: *when* (the table's step clock) and a decayed use count (how
hot it has been over the last ``window`` passes). The count, bucketed, is the
key's *class*. The policy keeps a histogram of reuse gaps per class, in passes
(one pass = the table visiting every layer once: one token in decode), and
turns it into ``score[class][age] = P(next use within `horizon` passes | unused
for `age` passes)``. The victim is the resident key with the lowest score.

Why it beats LRU on MoE routing: a key's chance of reuse depends more on how
often it was used lately than on how recently (Qwen3-30B-A3B code trace: a key
used once in the last 32 tokens is reused next token with p=0.16 even right
after its use; one used 16+ times is still reused with p=0.44 two tokens
later). LRU evicts the second first. See docs/policies.md, "Research".

Within one class an older key scores no higher (reuse odds fall with age), so
only the oldest unprotected key of each class is a candidate: a victim costs
one look per class (ten), not a scan of the pool.

The pass length is not given: it is the smallest step gap seen between two
uses of one key, since a step visits one layer and a layer comes once a pass
(a shorter gap must recur a few times before it is believed, so one odd step
order cannot shrink the clock).
That makes ages comparable across layers in a global pool. Until a key has
been reused the table is empty and the policy is plain LRU.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import OrderedDict

from .base import EvictionPolicy
from .registry import register

# Upper edges of the decayed-count classes (geometric: hotness spans 1..window).
_EDGES = (1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0)
_NCLASS = len(_EDGES) + 1
_GAPS = 64          # reuse gaps tracked one by one (passes); longer ones share one bucket
_TRUST = 4          # sightings of a shorter gap before the pass length shrinks to it
_MIN_OBS = 32       # a class with fewer reuses on record borrows the pooled score of all classes


@register
class NextUse(EvictionPolicy):
    name = "next-use"
    kernel = "next_use"  # policies/kernels/next_use.py
    kernel_mirrors = ("_use", "_believe", "_rebuild", "_scores")
    description = ("learned next-use: evict the key least likely to be reused within `horizon` "
                   "passes (tokens), from online reuse-gap statistics by decayed use count "
                   "(over `window` passes) and age")
    # tuned on the full code trace (window 16-128 x horizon 1-8, research/grid_kernel.py),
    # checked on the general trace and the synthetic presets (docs/policies.md, Research)
    params = {"window": 128.0, "horizon": 2}
    rebuild_every = 512    # recompute the score table after this many observed reuses (~0.1 ms)
    halve_every = 1 << 16  # then halve the histogram too, so it follows drift

    def __init__(self, capacity: int, window: float = 128.0, horizon: int = 2) -> None:
        super().__init__(capacity)
        if window < 1:
            raise ValueError(f"parameter 'window' of policy {self.name!r} must be at least 1 "
                             f"(passes, i.e. tokens in decode), got {window!r}")
        if not 1 <= horizon <= _GAPS:
            raise ValueError(f"parameter 'horizon' of policy {self.name!r} must be 1..{_GAPS} "
                             f"(passes, i.e. tokens in decode), got {horizon!r}")
        self.window, self.horizon = float(window), int(horizon)
        self._period = 0      # steps per pass; 0 until some key is reused
        self._shorter: dict[int, int] = {}   # gaps below the period -> times seen
        self._now = 0         # latest step seen (victim() is not told the clock)
        # key -> (step of its last use, decayed use count then, class then); kept after eviction
        self._info: dict[int, tuple[int, float, int]] = {}
        self._classes = [OrderedDict() for _ in range(_NCLASS)]  # resident keys, oldest first
        self._class: dict[int, int] = {}     # resident key -> its class
        # hist[c][g]: reuses after g passes by keys of class c (g = _GAPS + 1: longer)
        self._hist = [[0.0] * (_GAPS + 2) for _ in range(_NCLASS)]
        self._score = [[0.0] * (_GAPS + 1) for _ in range(_NCLASS)]
        self._seen = 0

    # -- learning -------------------------------------------------------------
    def _use(self, key: int, now: int) -> int:
        """Record a use of ``key`` at step ``now``; returns its new class. (The hot path.)"""
        self._now = now
        info = self._info.get(key)
        if info is None:
            count = 1.0
        elif now > info[0]:
            steps, period = now - info[0], self._period
            if period == 0 or (steps < period and self._believe(steps)):
                period = self._period = steps
            passes = steps / period
            gap = int(passes + 0.5)
            self._hist[info[2]][gap if gap <= _GAPS else _GAPS + 1] += 1.0
            count = 1.0 + info[1] * math.exp(-passes / self.window)
            self._seen += 1
            if self._seen % self.rebuild_every == 0:
                self._rebuild()
        else:
            count = info[1]            # same step again (seeding): no new evidence
        cls = bisect_right(_EDGES, count)
        self._info[key] = (now, count, cls)
        return cls

    def _believe(self, steps: int) -> bool:
        """A gap shorter than the pass length becomes the pass length on its _TRUST-th sighting."""
        seen = self._shorter[steps] = self._shorter.get(steps, 0) + 1
        if seen < _TRUST:
            return False
        self._shorter.clear()
        return True

    def _rebuild(self) -> None:
        if self._seen % self.halve_every == 0:
            self._hist = [[n / 2 for n in row] for row in self._hist]
        pooled = self._scores([sum(col) for col in zip(*self._hist)])
        for c, row in enumerate(self._hist):
            # too few observations: a noisy (or empty) row would mis-rank its keys
            self._score[c] = self._scores(row) if sum(row) >= _MIN_OBS else pooled

    def _scores(self, row: list[float]) -> list[float]:
        """score[a] = P(reuse within `horizon` passes | no reuse for a passes), from gap counts."""
        h, top = self.horizon, _GAPS + 1
        later = [0.0] * (top + 1)   # later[a]: reuses after more than a passes
        for g in range(top, 0, -1):
            later[g - 1] = later[g] + row[g]
        # within (a, a + h]; gaps past _GAPS sit in one bucket known only to be longer
        return [(later[a] - later[min(a + h, _GAPS)]) / later[a] if later[a] else 0.0
                for a in range(top)]

    # -- EvictionPolicy -------------------------------------------------------
    def on_insert(self, key: int, now: int) -> None:
        cls = self._use(key, now)
        old = self._class.get(key)
        if old == cls:
            members = self._classes[cls]
            members.move_to_end(key)
        else:
            if old is not None:
                del self._classes[old][key]
            self._class[key] = cls
            members = self._classes[cls]
        members[key] = now            # value: the last use, read by victim()

    on_access = on_insert

    def on_remove(self, key: int) -> None:
        del self._classes[self._class.pop(key)][key]

    def victim(self, protected) -> int | None:
        period, now = self._period or 1, self._now
        best, best_score, best_last = None, 2.0, 0
        for members, score in zip(self._classes, self._score):
            if not members:
                continue
            # oldest first: the first unprotected one. A step's keys were just used, so they
            # sit at the young end and the oldest key is nearly always the candidate.
            for key in members:
                if key not in protected:
                    break
            else:
                continue
            last = members[key]
            age = (now - last) // period
            odds = score[age] if age < _GAPS else score[_GAPS]
            # lowest reuse odds first; among equals, the least recently used
            if odds < best_score or (odds == best_score and last < best_last):
                best, best_score, best_last = key, odds, last
        return best


@register
class Default(NextUse):
    name = "default"
    description = ("default: currently next-use(window=128, horizon=2) with admission 'always' "
                   "(see docs/policies.md, Research)")
