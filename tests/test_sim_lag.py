"""``expertcache sim --lag``: the device planner's replay (sim/lag.py), torch-free."""

from __future__ import annotations

import json

import pytest

from expertcache.cli import main
from expertcache.sim.lag import lag_replay
from expertcache.sim.replay import Prepared, replay
from expertcache.trace.synth import synth_trace


@pytest.fixture(scope="module")
def prep():
    return Prepared(synth_trace("olmoe", 60, seed=2))


def test_lag_zero_is_the_replay_and_lags_count_every_access(prep):
    plain = replay(prep, "lru", 200)
    zero = lag_replay(prep, "lru", 200, lag=0)
    assert zero.stats.total() == plain.stats.total() and zero.host_copies == plain.misses
    for lag in (1, 2):
        r = lag_replay(prep, "lru", 200, lag=lag)
        total = r.stats.total()
        assert total.accesses == plain.accesses and total.hits + total.misses == total.accesses
        assert r.staged == total.misses  # every decode miss went through a staging row
        if lag == 1:  # the device's map is the table's state at each forward's start: lru admits
            # every device miss, and reloads keys it evicted earlier in the same forward, which
            # the device still held when their layer ran (hits that lag 0 would have missed)
            assert total.bypasses == 0 and total.loads > total.misses
        else:  # two forwards behind, some device misses are already in the table: not loaded
            assert 0 < total.bypasses < total.misses


def test_a_staging_block_per_layer_saves_the_second_copy(prep):
    shared = lag_replay(prep, "lru", 200, lag=1)
    ring = lag_replay(prep, "lru", 200, lag=1, blocks=prep.L)
    assert shared.stats.total() == ring.stats.total()  # bytes differ, hits do not
    assert ring.host_loads < shared.host_loads and ring.staging_loads > shared.staging_loads


def test_cli_lag_table_and_json(tmp_path, capsys):
    out = tmp_path / "lag.json"
    assert main(["sim", "synth:olmoe", "--tokens", "40", "--policy", "lru,fifo+second-hit", "--slots", "200",
                 "--lag", "0,1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "decode hit rate" in text and "host copies" in text
    doc = json.loads(out.read_text())
    assert [(r["policy"], r["lag"]) for r in doc["results"]] == [("lru", 0), ("lru", 1), ("fifo+second-hit", 0),
                                                                   ("fifo+second-hit", 1)]
    with pytest.raises(ValueError, match="lag must be"):
        lag_replay(synth_trace("olmoe", 10), "lru", 200, lag=-1)
