"""Short sequences per policy with the expected outcome of every access worked out
by hand (the reasoning is in the comments). One layer, one key per step unless
said otherwise. Outcomes: H hit, L miss loaded, B miss bypassed."""

from __future__ import annotations

import pytest

from expertcache import SlotTable
from expertcache.policies.belady import Future

from compiled_hooks import Compiled, arc_lists, s3fifo_queues, slru_segment  # tests/ on sys.path


def replay(eviction, seq, slots, experts=8, admission="always", **params):
    """Outcome letters and the key evicted at each step (None if none)."""
    table = SlotTable(1, experts, slots, eviction=eviction, admission=admission,
                      eviction_params=params.pop("eviction_params", None),
                      admission_params=params.pop("admission_params", None))
    if table.needs_future:
        table.bind_future(Future([[k] for k in seq]))
    out, evicted = [], []
    for key in seq:
        plan = table.step(0, [key])
        out.append("H" if plan.hits else "L" if plan.loads else "B")
        evicted.append(next(iter(plan.evictions), None))
    return "".join(out), evicted, table


SEQ = [0, 1, 2, 0, 3, 0, 1, 2]


def test_lru():
    # [0,1,2] 0 hit -> order 1,2,0; 3 evicts 1; 0 hit; 1 evicts 2; 2 evicts 3.
    out, ev, _ = replay("lru", SEQ, 3)
    assert out == "LLLHLHLL" and ev == [None, None, None, None, 1, None, 2, 3]


def test_lru_touches_a_step_in_rank_order():
    # Step [2, 1, 0] hits all three; rank 0 (expert 2) is touched first, so it is the oldest.
    table = SlotTable(1, 8, 3, eviction="lru")
    table.step(0, [0, 1, 2])
    table.step(0, [2, 1, 0])
    assert table.step(0, [3]).evictions == {2: table.slot_of(3)}


def test_fifo():
    # Hits do not reorder: 3 evicts 0 (loaded first) although 0 was just hit; then 0 evicts 1, ...
    out, ev, _ = replay("fifo", SEQ, 3)
    assert out == "LLLHLLLL" and ev == [None, None, None, None, 0, 1, 2, 3]


def test_belady():
    # At 3 the next uses are 0@5, 1@6, 2@7: evict 2, then 0 and 1 hit; 2 misses once more.
    out, ev, _ = replay("belady", SEQ, 3)
    assert out == "LLLHLHHL" and ev[4] == 2


def test_random_is_forced_by_protection_and_seeded():
    # Capacity 2 holding {0, 1}: the step [0, 2] may only evict 1, whatever the seed.
    for seed in range(20):
        table = SlotTable(1, 8, 2, eviction="random", eviction_params={"seed": seed})
        table.step(0, [0, 1])
        assert set(table.step(0, [0, 2]).evictions) == {1}
    seq = [i % 7 for i in range(0, 300, 3)]
    runs = [replay("random", seq, 3, eviction_params={"seed": s})[1] for s in (1, 1, 2)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_random_is_roughly_uniform():
    # Keep 4 keys resident, ask who goes; each should be picked about a quarter of the time.
    from expertcache.policies.registry import make_eviction
    policy = make_eviction("random", 4, seed=3)
    for k in range(4):
        policy.on_insert(k, 0)
    picks = {k: 0 for k in range(4)}
    for _ in range(4000):
        v = policy.victim(())
        picks[v % 4] += 1
        policy.on_remove(v)
        policy.on_insert(v + 4 if v < 4 else v - 4, 0)  # same residue class stays resident
    assert all(850 < picks[r] < 1150 for r in range(4)), picks


def test_lfu_without_aging():
    # Counts 0:3, 1:2; 2 (count 1) is evicted by 3, 3 (count 1) by 2, then 1 hits (3), 2 evicted by 3.
    seq = [0, 0, 0, 1, 1, 2, 3, 2, 1, 3, 0]
    out, ev, _ = replay("lfu", seq, 3, eviction_params={"decay": 10**6})
    assert out == "LHHLHLLLHLH" and ev == [None] * 6 + [2, 3, None, 2, None]


def test_lfu_aging_lets_old_popularity_fade():
    # decay=4: the 4th touch (insert of 1) halves 0:3 -> 1 and 1:1 -> 0. 2 evicts 1 (count 0);
    # 3 then finds 0 and 2 both at count 1 and evicts 0, the less recently touched: 0 misses.
    seq = [0, 0, 0, 1, 2, 3, 0]
    out, ev, table = replay("lfu", seq, 2, eviction_params={"decay": 4})
    assert out == "LHHLLLL" and ev[4:6] == [1, 0]
    # Without aging, 0 (count 3) outlives every newcomer and hits at the end.
    out, ev, _ = replay("lfu", seq, 2, eviction_params={"decay": 10**6})
    assert out == "LHHLLLH" and ev[4:6] == [1, 2]


def test_slru_resists_a_scan():
    # protected=0.5 of 4 slots: 0 and 1 are hit once each, so they sit in the protected
    # segment; the one-off 2, 3, 4 churn through probation (4 evicts 2) and 0, 1 still hit.
    seq = [0, 0, 1, 1, 2, 3, 4, 0, 1]
    out, ev, _ = replay("slru", seq, 4, eviction_params={"protected": 0.5})
    assert out == "LHLHLLLHH" and ev[6] == 2
    assert replay("lru", seq, 4)[0] == "LHLHLLLLL"  # LRU evicts 0 at 4, then 1 at 0, ...


def test_slru_demotes_protected_overflow_to_probation():
    # Protected holds 2 of 4; hitting 0, 1, 2 pushes 0 back to probation's recent end,
    # so 4 evicts 3 (probation's oldest), then 5 evicts the demoted 0.
    seq = [0, 1, 2, 3, 0, 1, 2, 4, 5]
    out, ev, table = replay("slru", seq, 4, eviction_params={"protected": 0.5})
    assert out == "LLLLHHHLL" and ev[7:] == [3, 0]
    st = table.kernel.st
    assert [slru_segment(st, k) for k in (1, 2, 4, 5)] == ["protected"] * 2 + ["probation"] * 2


def test_lfru_blends_frequency_and_recency():
    # halflife 2 touches; score = sum of 2**(-age/2). After 0,0,0,1: score(0)=2.207 at t3,
    # score(1)=1 at t4. t5 (2): 0 is worth 1.56 > 1, evict 1 (LRU would evict 0).
    # t6 (1): 0 now 1.10 > 2's 1.0, evict 2. t7 (3): 0 has faded to 0.78 < 1, evict 0
    # (LFU would keep it). t8 (0): 1 at 0.71 < 3 at 1.0, evict 1.
    seq = [0, 0, 0, 1, 2, 1, 3, 0]
    out, ev, _ = replay("lfru", seq, 2, eviction_params={"halflife": 2.0})
    assert out == "LHHLLLLL" and ev[4:] == [1, 2, 0, 1]


def test_lfru_with_a_tiny_halflife_is_lru():
    seq = [(i * 7 + i // 3) % 9 for i in range(200)]
    assert replay("lfru", seq, 4, experts=9, eviction_params={"halflife": 1e-3})[:2] == \
        replay("lru", seq, 4, experts=9)[:2]


def test_arc_adapts_its_target():
    # Capacity 2 (p = 0). 0 hit -> T2. 2 evicts T1's 1 (B1=[1]); 1 evicts T1's 2 and, being in
    # B1, raises p to 1 and goes to T2=[0,1]. 3: |T1|=0 <= p, evict T2's 0 (B2=[0]). 2 (in B1,
    # |B2|/|B1| = 2) raises p to 2 after evicting T2's 1. 0 (in B2) lowers p to 1, evicting 2.
    out, ev, table = replay("arc", [0, 1, 0, 2, 1, 3, 2, 0], 2)
    assert out == "LLHLLLLL" and ev[3:] == [1, 2, 0, 1, 2]
    assert arc_lists(table.kernel.st) == ({"t1": [3], "t2": [0], "b1": [], "b2": [1, 2]}, 1.0)


def test_s3fifo_queues():
    # small=0.25 of 4 -> S target 1. 0..3 enter S; 0 is hit. 4: S's 0 was hit -> promoted to M,
    # 1 is the victim (ghost). 1 returns from the ghost straight to M, evicting S's 2. 0 hit (M).
    # 5 evicts 3; 2 (ghost) evicts 4 and joins M. 5 hit in S. 6: S's only key was hit, so all
    # of S (5) moves to M with count 0 and M's CLOCK runs over [0:1, 1:0, 2:0, 5:0]: 0 gets
    # a second chance (to the back, count 0), 1 (count 0) is the victim; it leaves M, so it
    # does not enter the ghost.
    seq = [0, 1, 2, 3, 0, 4, 1, 0, 5, 2, 5, 6]
    out, ev, table = replay("s3fifo", seq, 4, eviction_params={"small": 0.25})
    assert out == "LLLLHLLHLLHL"
    assert [e for e in ev if e is not None] == [1, 2, 3, 4, 1]
    q = s3fifo_queues(table.kernel.st)
    assert q == {"small": {6: 0}, "main": {2: 0, 5: 0, 0: 0}, "ghost": [3, 4]}
    assert list(q["main"]) == [2, 5, 0]


def test_s3fifo_clock_goes_round_until_the_lowest_count():
    # M = [0:2, 1:1, 2:3] and S = [3:1]. S is due but its only key was hit, so S moves to M
    # with count 0: [0:2, 1:1, 2:3, 3:0]. CLOCK by hand: round 1 ages 0, 1, 2 and stops at 3.
    # With 3 protected (the step needs it): round 1 ages all to [0:1, 1:0, 2:2, 3:0] (3 is
    # skipped), round 2 ages 0 to 0 and stops at 1. Left: [2:2, 3:0, 0:0] in that order.
    from expertcache.policies.registry import make_eviction
    p = Compiled(make_eviction("s3fifo", 4, small=0.25))
    for k in range(4):
        p.on_insert(k, 0)
    for k in range(3):
        p.on_remove(p.victim(()))  # 0, 1, 2 go to the ghost
    for k in range(3):
        p.on_insert(k, 0)          # ... and come back into M
    for k, hits in {0: 2, 1: 1, 2: 3, 3: 1}.items():
        for _ in range(hits):
            p.on_access(k, 0)
    assert p.victim(()) == 3 and p.victim({3}) == 1 and p.victim({1, 3}) == 0
    p.on_remove(1)
    assert list(s3fifo_queues(p.st)["main"].items()) == [(2, 2), (3, 0), (0, 0)]
    assert s3fifo_queues(p.st)["small"] == {}


def s3fifo_with_main(counts: dict[int, int]):
    """An s3fifo policy whose M holds ``counts`` (key -> hits) in that order and whose S is
    empty (so the next victim comes from M's CLOCK)."""
    from expertcache.policies.registry import make_eviction
    p = Compiled(make_eviction("s3fifo", len(counts) + 1, small=0.01))  # S target 1
    for k in counts:
        p.on_insert(k, 0)
    for _ in counts:
        p.on_remove(p.victim(()))  # oldest first: every key goes to the ghost ...
    for k in counts:
        p.on_insert(k, 0)          # ... and comes back into M with count 0
    for k, hits in counts.items():
        for _ in range(hits):
            p.on_access(k, 0)
    q = s3fifo_queues(p.st)
    assert q["main"] == counts and list(q["main"]) == list(counts)
    assert q["small"] == {}
    return p


def test_s3fifo_keys_the_hand_passes_lose_f_plus_one_only():
    # Regression: the sweep used to take f + 1 from keys before the victim and then f again.
    # M = [1:3, 2:1, 3:3]. Round 1: 1 -> 2, 2 -> 0, 3 -> 2 (each to the back). Round 2: 1 -> 1,
    # then 2 has count 0: the victim. Left, in order: [3:2, 1:1].
    p = s3fifo_with_main({1: 3, 2: 1, 3: 3})
    assert p.victim(()) == 2
    p.on_remove(2)
    assert list(s3fifo_queues(p.st)["main"].items()) == [(3, 2), (1, 1)]


def literal_clock(counts: dict[int, int], protected) -> tuple[int, list[tuple[int, int]]]:
    """S3-FIFO's M as the paper runs it: the hand takes the front key; count 0 and not
    protected -> evicted, else count - 1 (not below 0) and to the back."""
    queue = list(counts.items())
    while True:
        key, count = queue.pop(0)
        if count == 0 and key not in protected:
            return key, queue
        queue.append((key, max(0, count - 1)))


def test_s3fifo_sweep_equals_a_literal_clock():
    # The pure victim() plus on_remove's one-shot sweep must land exactly where the literal
    # CLOCK does, for every queue of up to 5 keys (counts 0..3) and protected subsets.
    import itertools
    import random
    rng = random.Random(5)
    for n in range(1, 6):
        for counts in itertools.product(range(4), repeat=n):
            keys = rng.sample(range(20), n)
            protected = {k for k in keys if rng.random() < 0.3}
            if len(protected) == n:
                protected.pop()
            state = dict(zip(keys, counts))
            p = s3fifo_with_main(state)
            victim, left = literal_clock(state, protected)
            assert p.victim(protected) == victim, (state, protected)
            p.on_remove(victim)
            assert list(s3fifo_queues(p.st)["main"].items()) == left, (state, protected)


def test_static_pins_and_runs_lru_for_the_rest():
    # keys 1, 2 pinned (slots 0, 1); LRU over the other 2 slots: 5 evicts 3, 3 evicts 4.
    seq = [1, 2, 3, 4, 5, 3, 1]
    out, ev, table = replay("static", seq, 4, eviction_params={"keys": "1, 2"})
    assert out == "HHLLLLH" and ev[4:6] == [3, 4]
    assert table.slot_of(1) == 0 and table.slot_of(2) == 1 and table.pinned == {1, 2}


def test_static_with_fifo_inner():
    seq = [3, 4, 3, 5, 3]
    assert replay("static", seq, 3, eviction_params={"keys": [0], "inner": "fifo"})[0] == "LLHLL"
    assert replay("static", seq, 3, eviction_params={"keys": [0], "inner": "lru"})[0] == "LLHLH"


# -- admission ----------------------------------------------------------------
def test_never_admits_nothing():
    out, _, table = replay("lru", [0, 0, 1], 2, admission="never")
    assert out == "BBB" and table.resident() == {}


def test_second_hit():
    # 0 takes the free slot. 1 is new: bypass; 1 again: seen, admitted (evicts 0).
    # 0 was seen at step 0: admitted; then it hits.
    out, ev, _ = replay("lru", [0, 1, 1, 0, 0], 1, admission="second-hit")
    assert out == "LBLLH" and ev == [None, None, 0, 1, None]


def test_second_hit_ghost_is_bounded():
    # ghost=1 remembers only the latest key: by step 3, 1 has been forgotten (2 displaced it).
    seq = [0, 1, 2, 1]
    assert replay("lru", seq, 1, admission="second-hit", admission_params={"ghost": 1})[0] == "LBBB"
    assert replay("lru", seq, 1, admission="second-hit")[0] == "LBBL"


@pytest.mark.parametrize("w, expected", [(3, "LBBLLH"), (2, "LBBBBL")])
def test_window(w, expected):
    # n=2. w=3: 1's uses at steps 1, 3 fall in the last 3 steps -> admitted; likewise 2 at 2, 4.
    # w=2: uses two steps apart never share a window; 2 is admitted at 5 (uses at 4, 5).
    out, _, _ = replay("lru", [0, 1, 2, 1, 2, 2], 1, admission="window",
                       admission_params={"n": 2, "w": w})
    assert out == expected


def test_window_counts_steps_of_the_key_s_own_layer():
    # Global pool of 1 slot over 2 layers. Key (0,1) is used at layer-0 steps 1 and 2: within
    # w=2 of its layer's clock, though 4 global steps apart (layer 1 ran in between).
    table = SlotTable(2, 4, 1, eviction="lru", admission="window", admission_params={"n": 2, "w": 2})
    table.step(0, [0])
    table.step(1, [1])
    assert table.step(0, [1]).bypasses == [1]
    table.step(1, [2])
    assert table.step(0, [1]).loads == {1: 0}
