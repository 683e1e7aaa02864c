"""``expertcache sim --lag``: the device planner's replay (sim/lag.py), torch-free."""

from __future__ import annotations

import json

import numpy as np
import pytest

from expertcache.cli import main
from expertcache.sim.lag import lag_replay, lag_replays
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
    assert [(r["label"], r["lag"]) for r in doc["results"]] == [("lru", 0), ("lru", 1), ("fifo+second-hit", 0),
                                                                  ("fifo+second-hit", 1)]
    assert [(r["policy"], r["admission"]) for r in doc["results"]][2] == ("fifo", "second-hit")
    assert doc["results"][2]["admission_params"] == {"ghost": 4096}  # the rule as run, with its parameters
    with pytest.raises(ValueError, match="lag must be"):
        lag_replay(synth_trace("olmoe", 10), "lru", 200, lag=-1)


def test_lag_json_has_plain_sims_layout(tmp_path):
    plain, lagged = tmp_path / "plain.json", tmp_path / "lag.json"
    argv = ["sim", "synth:olmoe", "--tokens", "30", "--policy", "default", "--slots", "200"]
    assert main([*argv, "--json", str(plain)]) == 0
    assert main([*argv, "--lag", "0,1", "--lag-blocks", "2", "--json", str(lagged)]) == 0
    p, q = json.loads(plain.read_text()), json.loads(lagged.read_text())
    assert set(p) <= set(q) and q["lag"] == {"blocks": 2, "staging_rows": 8}
    assert p["trace"] == q["trace"] and (q["trace"]["requests"], q["trace"]["steps"]) == (1, 30)
    shared = set(p["results"][0]) - {"opt_misses", "bytes_moved", "predicted_tok_s"}
    assert shared <= set(q["results"][0])
    for key in ("policy", "admission", "label", "eviction_params", "admission_params", "hits", "misses"):
        assert q["results"][0][key] == p["results"][0][key], key  # lag 0 is the plain replay
    assert q["results"][0]["admission"] == "freq" and q["results"][0]["admission_params"]["reset"] == 16384


def _tiny(T=50, L=3, E=16, K=2, seed=0, prompt=0):
    """Random routing with a little locality: each token keeps one expert of the previous."""
    from expertcache.trace.format import Trace
    rng = np.random.default_rng(seed)
    ex = np.zeros((L, T, K), np.int16)
    for layer in range(L):
        for t in range(T):
            keep = [ex[layer, t - 1, 0]] if t and rng.random() < 0.6 else []
            rest = [e for e in rng.permutation(E) if e not in keep][:K - len(keep)]
            ex[layer, t] = keep + rest
    phase = (np.arange(T) >= prompt).astype(np.uint8)
    return Trace(ex, {"num_experts": E, "top_k": K, "n_moe_layers": L}, phase=phase)


def _cases():
    from expertcache.trace.batch import batch_traces
    yield "tokens", Prepared(_tiny())
    yield "prompt", Prepared(_tiny(prompt=6, seed=1))              # the prompt as one batched step
    yield "batched", Prepared(batch_traces([_tiny(80, seed=2)], 4, prompt=4, prompt_chunk=3))


@pytest.mark.parametrize("policy", ["lru", "default", "slru+second-hit", "fifo+window", "belady",
                                    "belady+oracle", "lfu", "arc", "s3fifo", "next-use+freq"])
def test_compiled_lag_equals_lagged_table(policy):
    # The fast path (one compiled replay's log, sim/lagkernel.py) against LaggedTable itself,
    # count for count and byte for byte, at every lag, both partitions, shared and per-layer
    # staging blocks, on token, prompt and batched traces.
    for name, prep in _cases():
        for partition, slots, blocks in (("global", 9, 1), ("global", 15, 3), ("per-layer", 9, 3),
                                         ("per-layer", 15, 1)):
            fast = lag_replays(prep, policy, slots, partition, [0, 1, 2, 3], blocks=blocks)
            slow = lag_replays(prep, policy, slots, partition, [0, 1, 2, 3], blocks=blocks, engine="table")
            for f, s in zip(fast, slow):
                where = (name, partition, slots, blocks, f.lag)
                assert f.engine == "lagged-kernel" and s.engine == "table"
                assert f.stats.to_dict() == s.stats.to_dict(), where
                assert (f.staged, f.staging_loads, f.host_loads, f.planned) == \
                    (s.staged, s.staging_loads, s.host_loads, s.planned), where
            assert fast[1].stats.total().misses > 0


def test_lag_flags_say_what_is_wrong(capsys):
    argv = ["sim", "synth:olmoe", "--tokens", "20", "--policy", "lru", "--slots", "200"]
    for extra, words in ((["--lag", "1", "--lag-blocks", "0"], "--lag-blocks must be a whole number in 1..16"),
                         (["--lag", "1", "--lag-blocks", "1000"], "--lag-blocks must be a whole number in 1..16"),
                         (["--lag-blocks", "4"], "--lag-blocks applies to --lag"),
                         (["--lag", "1", "--plot", "x.png"], "--lag replays without --plot")):
        assert main([*argv, *extra]) == 2
        assert words in capsys.readouterr().err
    assert main([*argv, "--lag", "0,1,25"]) == 0
    out = capsys.readouterr()
    assert "warning: --lag 25 is not below the 20 decode forwards" in out.err and "--lag 1 " not in out.err
    assert "lag >= 1: the policy decides once a forward has finished" in out.out  # why lag 1 may beat lag 0


def test_lag_progress_is_reported():
    from expertcache.cli.simlag import run_lags
    seen = []
    prep = Prepared(_tiny())
    run_lags(prep, ["lru", "fifo"], [6, 9], "global", [0, 1], 1, None, progress=lambda d, t: seen.append((d, t)))
    assert seen == [(1, 4), (2, 4), (3, 4), (4, 4)]
