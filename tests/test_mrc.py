"""Sweeps equal one replay per (policy, size), in-process or in worker processes,
and the curve is drawn; sweep sizes span the legal range."""

from __future__ import annotations

import numpy as np
import pytest

from expertcache.sim import Prepared, replay
from expertcache.sim.mrc import optimum_misses, sweep, sweep_sizes
from expertcache.sim.plot import plot_curves
from expertcache.trace import Trace
from png_check import pixels, width_of  # tests/ is on sys.path (not a package)


@pytest.fixture(scope="module")
def prep() -> Prepared:
    rng = np.random.default_rng(9)
    L, E, k, T = 3, 12, 2, 120
    ex = rng.choice(E, size=(L, T, k), p=rng.dirichlet(np.full(E, 0.4))).astype(np.int16)
    return Prepared(Trace(ex, {"num_experts": E, "top_k": k, "n_moe_layers": L}))


POLICIES = ["lru", "fifo", "belady", "lru+second-hit", "fifo+window"]


@pytest.mark.parametrize("partition", ["global", "per-layer"])
def test_sweep_equals_single_replays(prep, partition):
    sizes = [6, 9, 18, 36]
    got = sweep(prep, POLICIES, sizes, partition, workers=1)
    assert [(r.label, r.slots) for r in got] == [(p, s) for p in POLICIES for s in sizes]
    for r in got:
        one = replay(prep, r.label, r.slots, partition, engine="table")
        assert r.stats.to_dict() == one.stats.to_dict(), (r.label, r.slots)
    opt = optimum_misses(prep, sizes, partition)
    assert all(r.misses >= opt[r.slots] for r in got if r.admission == "always")


def test_worker_processes_give_the_same_results(prep):
    ticks = []
    inline = sweep(prep, POLICIES, [6, 12], workers=1)
    pooled = sweep(prep, POLICIES, [6, 12], workers=2, progress=lambda d, n: ticks.append((d, n)))
    assert [r.stats.to_dict() for r in pooled] == [r.stats.to_dict() for r in inline]
    assert ticks[-1] == (10, 10) and len(ticks) == 10


def test_sweep_sizes_span_smallest_to_all(prep):
    tr = prep.trace
    assert sweep_sizes(tr, "global", 5) == [2, 10, 19, 28, 36]
    per = sweep_sizes(tr, "per-layer", 4)
    assert per[0] == tr.top_k * tr.num_layers and per[-1] == tr.num_experts * tr.num_layers
    assert all(s % tr.num_layers == 0 for s in per)
    with pytest.raises(ValueError, match="at least 2"):
        sweep_sizes(tr, "global", 1)


def test_sweep_rejects_bad_input_before_any_work(prep):
    with pytest.raises(ValueError, match="below top-k"):
        sweep(prep, ["lru"], [1])
    with pytest.raises(ValueError, match="known eviction"):
        sweep(prep, ["lru", "nosuch"], [6])


def test_plot_writes_a_png(prep, tmp_path):
    results = sweep(prep, ["lru", "belady"], [4, 8, 16], workers=1)
    out = plot_curves(results, tmp_path / "mrc.png", title="t", total_experts=36)
    rgb = pixels(out, (840, 540))  # figsize 7 x 4.5 inches at 120 dpi
    assert width_of(rgb, "tab:blue") > 0.15  # lru's curve (belady's is black, like the axes)
