"""The fast kernels equal libCacheSim's C replay of an oracleGeneral trace file where
the semantics coincide: one key per step (one layer, top-1), so no step protection."""

from __future__ import annotations

import numpy as np
import pytest

libcachesim = pytest.importorskip("libcachesim", reason="libcachesim is a test dependency")

from expertcache.sim import Prepared, replay  # noqa: E402
from expertcache.sim.mrc import sweep  # noqa: E402
from expertcache.trace import Trace  # noqa: E402
from oracle_trace import RECORD, flat_accesses, write_oracle_general  # noqa: E402

REFERENCE = {"lru": libcachesim.LRU, "fifo": libcachesim.FIFO, "belady": libcachesim.Belady}


def one_key_trace(rng, experts: int, n: int) -> Trace:
    seq = rng.choice(experts, size=n, p=rng.dirichlet(np.full(experts, 0.3)))
    for i in np.flatnonzero(rng.random(n - 1) < 0.2):  # bursts of reuse
        seq[i + 1] = seq[i]
    return Trace(seq.reshape(1, n, 1).astype(np.int16),
                 {"num_experts": experts, "top_k": 1, "n_moe_layers": 1})


def test_oracle_general_file_layout(tmp_path):
    path = write_oracle_general(np.array([5, 7, 5, 5, 9]), tmp_path / "t.bin")
    rec = np.fromfile(path, RECORD)
    assert RECORD.itemsize == 24
    assert rec["id"].tolist() == [6, 8, 6, 6, 10]         # ids shifted clear of 0
    assert rec["next"].tolist() == [2, -1, 3, -1, -1]     # index of the next request, -1 never
    keys = np.array([[3, -1], [4, 3]], np.int32)
    assert flat_accesses(keys).tolist() == [3, 4, 3]


@pytest.mark.parametrize("policy", sorted(REFERENCE))
def test_kernels_equal_libcachesim_file_replay(policy, tmp_path):
    rng = np.random.default_rng(sorted(REFERENCE).index(policy))
    for i in range(12):
        experts = int(rng.integers(3, 60))
        trace = one_key_trace(rng, experts, int(rng.integers(50, 3000)))
        path = write_oracle_general(trace.experts.reshape(-1), tmp_path / f"{i}.bin")
        reader = libcachesim.TraceReader(str(path), libcachesim.TraceType.ORACLE_GENERAL_TRACE)
        prep = Prepared(trace)
        sizes = sorted({1, 2, experts // 3 or 1, experts - 1 or 1})
        curve = sweep(prep, [policy], sizes, workers=1)
        for slots, r in zip(sizes, curve):
            miss_ratio, _ = REFERENCE[policy](slots, hashpower=12).process_trace(reader)
            n = trace.num_tokens
            assert r.misses == round(miss_ratio * n), (policy, slots, experts, n)
            assert replay(prep, policy, slots, engine="fast").misses == r.misses
