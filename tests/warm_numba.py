"""Compile the built-in policies' kernels into numba's on-disk cache, before the test workers start.

``python tests/warm_numba.py [POLICY ...]`` (default: all of ``POLICIES``) drives each policy
through the paths the tests take (a replay, a lagged replay, a ``SlotTable``'s seed and steps),
so every entry point is compiled with the argument types the tests pass, in two processes that
take every other policy. ``make test`` runs it before the main suite: on a cold cache
pytest-xdist's workers each compiled the kernels they met, some twice (2-core sandbox: the main
suite took 6:32 cold, 3:46 warm). The vLLM suite does not: its venv's numba (0.65, vLLM's pin)
keeps a cache index of its own, and warming its two policies first gained nothing there.
"""

from __future__ import annotations

import sys
from concurrent.futures import ProcessPoolExecutor

# One policy per kernel module (policies/kernels): 'default' is next_use with freq admission,
# 'lru' also covers fifo, 'lfru+second-hit' is a plug-in eviction with a compiled admission
# (skeleton.admit_row). Ordered so that every other one takes half the compile time (cold, 2-core
# sandbox: arc 34 s, lfu 34, belady 27, lru 25 | default 38, s3fifo 38, slru 27, lfru 1).
POLICIES = ("arc", "default", "lfu", "s3fifo", "belady", "slru", "lru", "lfru+second-hit")


def warm(policy: str) -> None:
    from expertcache.cache import SlotTable
    from expertcache.sim.lag import lag_replay
    from expertcache.sim.mrc import STACK_SIZES, sweep
    from expertcache.sim.replay import Prepared, replay
    from expertcache.trace.synth import synth_trace

    trace = synth_trace("olmoe", 24, seed=0, prompt=4)
    prep = Prepared(trace)
    slots = trace.num_layers * trace.top_k * 2
    for partition in ("global", "per-layer"):
        replay(prep, policy, slots, partition)
        lag_replay(prep, policy, slots, partition, lag=1)
    if policy == "belady":  # it needs the future: the table engine binds it (no live table)
        replay(prep, policy, slots, engine="table")
        return
    if policy == "lru":  # every size in one pass (sim/stack.py)
        sweep(prep, [policy], [slots * (i + 1) for i in range(STACK_SIZES)])
    eviction, _, admission = policy.partition("+")
    table = SlotTable(trace.num_layers, trace.num_experts, slots, eviction=eviction,
                      admission=admission or None, top_k=trace.top_k)
    table.seed([(0, 0)])
    for layer in range(trace.num_layers):
        table.step(layer, list(range(trace.top_k)))


def warm_all(policies) -> None:
    for policy in policies:
        warm(policy)


if __name__ == "__main__":
    names = tuple(sys.argv[1:]) or POLICIES
    with ProcessPoolExecutor(2) as pool:
        list(pool.map(warm_all, [names[0::2], names[1::2]]))
