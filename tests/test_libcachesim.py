"""LRU, FIFO, Belady, LFU (aging off) and S3-FIFO agree exactly with libCacheSim on
traces of one key per step, where the two semantics coincide (no step protection is
needed). S3-FIFO is compared with libCacheSim's original ``S3FIFOv0`` at the settings
that are ours (promote after one hit, a ghost as large as the cache, a small queue of a
whole number of at least 2 slots: libCacheSim refuses objects as large as its small
queue). ARC is not compared: its target adapts before the eviction there."""

from __future__ import annotations

import random

import pytest

libcachesim = pytest.importorskip("libcachesim", reason="libcachesim is a test dependency: pip install libcachesim")

from expertcache import SlotTable  # noqa: E402
from expertcache.policies.belady import Future  # noqa: E402

INT64_MAX = (1 << 63) - 1
REFERENCE = {"lru": libcachesim.LRU, "fifo": libcachesim.FIFO, "belady": libcachesim.Belady,
             "lfu": libcachesim.LFU}
PARAMS = {"lfu": {"decay": 10**9}}  # plain in-cache LFU, as libCacheSim's (ties: least recent)


def next_access(seq: list[int]) -> list[int]:
    """libCacheSim's Belady reads each request's next use (index) from the request."""
    out, last = [INT64_MAX] * len(seq), {}
    for i in range(len(seq) - 1, -1, -1):
        out[i] = last.get(seq[i], INT64_MAX)
        last[seq[i]] = i
    return out


def libcachesim_hits(policy: str, seq: list[int], capacity: int) -> int:
    cache = REFERENCE[policy](capacity, hashpower=12)  # the default 2**24 buckets cost ~50 ms each
    hits = 0
    for key, nxt in zip(seq, next_access(seq)):
        # obj_id + 1: keep clear of id 0; each expert is one unit of size.
        hits += cache.get(libcachesim.Request(obj_size=1, obj_id=key + 1, next_access_vtime=nxt))
    return hits


def table_hits(policy: str, seq: list[int], experts: int, capacity: int) -> int:
    table = SlotTable(1, experts, capacity, eviction=policy, eviction_params=PARAMS.get(policy))
    if policy == "belady":
        table.bind_future(Future([[k] for k in seq]))
    for key in seq:
        table.step(0, [key])
    return table.stats().total().hits


def skewed_sequence(rng: random.Random, experts: int, n: int) -> list[int]:
    weights = [1.0 / (i + 1) ** rng.uniform(0.3, 1.2) for i in range(experts)]
    seq = rng.choices(range(experts), weights=weights, k=n)
    # Runs of reuse, like consecutive tokens sharing experts.
    return [seq[i - 1] if i and rng.random() < 0.2 else x for i, x in enumerate(seq)]


@pytest.mark.parametrize("policy", sorted(REFERENCE))
def test_agrees_with_libcachesim_on_random_traces(policy):
    rng = random.Random(policy)
    for _ in range(150):
        experts = rng.randint(2, 40)
        capacity = rng.randint(1, experts)
        seq = skewed_sequence(rng, experts, rng.randint(1, 400))
        assert table_hits(policy, seq, experts, capacity) == libcachesim_hits(policy, seq, capacity), \
            (experts, capacity, seq)


def test_policies_differ_on_this_workload():
    # Agreement must not be vacuous: the policies give different hit counts here.
    rng = random.Random(7)
    seq = skewed_sequence(rng, 30, 2000)
    hits = {p: libcachesim_hits(p, seq, 8) for p in REFERENCE}
    assert len(set(hits.values())) == len(REFERENCE) and hits["belady"] == max(hits.values())


def libcachesim_s3fifo(capacity: int, small: float):
    """libCacheSim's original S3-FIFO (only its init function is exported to Python)."""
    from libcachesim.cache import CacheBase, _create_common_params
    init = getattr(libcachesim.libcachesim_python, "S3FIFOv0_init", None)
    if init is None:
        pytest.skip("this libcachesim build does not export S3FIFOv0_init")
    params = f"small-size-ratio={small}, ghost-size-ratio=1.0, move-to-main-threshold=1"
    return CacheBase(_cache=init(_create_common_params(capacity, hashpower=12), params))


def test_s3fifo_agrees_with_libcachesim_s3fifo_v0():
    rng = random.Random("s3fifo")
    differs_from_fifo = 0
    for _ in range(120):
        small = rng.choice([0.125, 0.25, 0.5])  # exact in binary: capacity x small is whole
        capacity = rng.choice([c for c in (8, 16, 24, 32, 48) if c * small >= 2])
        experts = rng.randint(capacity + 1, 4 * capacity)
        seq = skewed_sequence(rng, experts, rng.randint(50, 500))
        table = SlotTable(1, experts, capacity, eviction="s3fifo", eviction_params={"small": small})
        for key in seq:
            table.step(0, [key])
        ours = table.stats().total().hits
        cache = libcachesim_s3fifo(capacity, small)
        theirs = sum(cache.get(libcachesim.Request(obj_size=1, obj_id=k + 1)) for k in seq)
        assert ours == theirs, (capacity, small, seq)
        differs_from_fifo += ours != table_hits("fifo", seq, experts, capacity)
    assert differs_from_fifo > 60  # not a FIFO in disguise
