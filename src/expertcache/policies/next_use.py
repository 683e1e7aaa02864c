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

The logic is compiled: ``policies/kernels/next_use.py``; this class holds the
parameters, their checks and the constants the kernel reads.
"""

from __future__ import annotations

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


@register
class Default(NextUse):
    name = "default"
    description = ("default: currently next-use(window=128, horizon=2) with admission "
                   "'freq:reset=16384' unless another is named (batched steps weigh a miss against "
                   "its victim; one token's steps admit all: docs/policies.md, Batched workloads)")
    # Its admission when none is named (registry.own_admission; a named one, 'always' too, wins):
    # under batched decode a forward pass needs more keys than fit, and admitting every miss
    # flushes what the next pass needs (issue 25).
    admission = "freq:reset=16384"
