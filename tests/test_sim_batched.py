"""Replaying recorded traces in the runtime's step order (meta ``prefill_steps: batched``):
the prompt is ONE step per layer (the union of its tokens' experts). The simulator's
table path equals ``live_oracle.replay_live`` (the order the live run planned), every
numba kernel equals the table path on such traces, including caches smaller than the
prompt's step (bypasses), and ``expertcache sim`` on a recorded tiny model reproduces the
live run's hits and misses."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from live_oracle import live_steps, replay_live  # tests/ is on sys.path (not a package)

from expertcache import SlotTable
from expertcache.sim.replay import Prepared, lru_all_sizes, replay
from expertcache.trace import Trace
from expertcache.trace.steps import step_rows

KERNELS = ["lru", "fifo", "belady", "slru", "arc", "lfu", "s3fifo", "lru+second-hit",
           "fifo+window", "next-use"]


def batched_trace(rng: np.random.Generator, meta: str | None = "batched") -> Trace:
    """A random trace with a prompt of several tokens, then decode tokens."""
    L, E = int(rng.integers(1, 4)), int(rng.integers(3, 16))
    k, P, D = int(rng.integers(1, min(E, 4) + 1)), int(rng.integers(2, 9)), int(rng.integers(0, 30))
    p = rng.dirichlet(np.full(E, 0.5))
    ex = rng.choice(E, size=(L, P + D, k), p=p).astype(np.int16)  # repeats in a step too
    phase = np.array([0] * P + [1] * D, np.uint8)
    meta = {"num_experts": E, "top_k": k, "n_moe_layers": L}
    if meta is not None:
        meta["prefill_steps"] = "batched"
    return Trace(ex, meta, phase=phase)


def sizes(prep: Prepared, partition: str) -> list[int]:
    """Per-partition capacities from top-k (below the prompt's widest step) to all experts."""
    k, E, L = prep.trace.top_k, prep.E, prep.L
    caps = {k, k + 1, prep.widest_step - 1, prep.widest_step, E}
    per = L if partition == "per-layer" else 1
    return sorted(c * per for c in caps if c >= k)


def test_rows_follow_the_live_order():
    rng = np.random.default_rng(1)
    for _ in range(30):
        trace = batched_trace(rng)
        rows, phases = step_rows(trace)
        flat = [(layer, ex, ph) for row, ph in zip(rows, phases) for layer, ex in enumerate(row)]
        live = [(layer, list(dict.fromkeys(ex)), ph) for layer, ex, ph in live_steps(trace)]
        assert flat == live


def test_prompt_is_one_step_per_layer_by_hand():
    # 2 prompt tokens then 1 decode token, one layer, top-2. Prompt union in token-major rank
    # order: [3, 1] + [1, 5] -> step [3, 1, 5]; with 2 slots 5 is bypassed (both others are the
    # step's own). Token by token instead: [3, 1] loads, [1, 5] hits 1 and evicts 3 for 5.
    ex = np.array([[[3, 1], [1, 5], [5, 3]]], np.int16)
    meta = {"num_experts": 8, "top_k": 2, "n_moe_layers": 1}
    phase = np.array([0, 0, 1], np.uint8)
    batched = Trace(ex, {**meta, "prefill_steps": "batched"}, phase=phase)
    prep = Prepared(batched)
    assert prep.step_lists == [[[3, 1, 5]], [[5, 3]]] and prep.row_phases == [0, 1]
    assert prep.keys.tolist() == [[3, 1, 5], [5, 3, -1]] and prep.widest_step == 3
    pre = replay(batched, "lru", 2).stats.total(0)
    assert (pre.accesses, pre.hits, pre.loads, pre.bypasses) == (3, 0, 2, 1)
    token = replay(Trace(ex, meta, phase=phase), "lru", 2).stats.total(0)
    assert (token.accesses, token.hits, token.loads, token.evictions) == (4, 1, 3, 1)
    # order= overrides the meta
    assert replay(Prepared(batched, "token"), "lru", 2).stats.total(0).accesses == 4
    with pytest.raises(ValueError, match="unknown step order"):
        Prepared(batched, "prompt")


@pytest.mark.parametrize("partition", ["global", "per-layer"])
def test_table_replay_equals_replay_live(partition):
    rng = np.random.default_rng(2 if partition == "global" else 3)
    for _ in range(25):
        prep = Prepared(batched_trace(rng))
        tr = prep.trace
        for slots in sizes(prep, partition):
            for policy in ("lru", "s3fifo", "slru+second-hit"):
                eviction, _, admission = policy.partition("+")
                table = SlotTable(tr.num_layers, tr.num_experts, slots, eviction=eviction,
                                  admission=admission or "always", partition=partition,
                                  top_k=tr.top_k)
                want = replay_live(tr, table).to_dict()
                got = replay(prep, policy, slots, partition, engine="table").stats.to_dict()
                assert got == want, (policy, slots, tr.experts.tolist())


@pytest.mark.parametrize("policy", KERNELS)
@pytest.mark.parametrize("partition", ["global", "per-layer"])
def test_kernels_equal_the_table_on_batched_traces(policy, partition):
    rng = np.random.default_rng([ord(c) for c in policy + partition])
    bypassed = 0
    for _ in range(25):
        prep = Prepared(batched_trace(rng))
        for slots in sizes(prep, partition):
            table = replay(prep, policy, slots, partition, engine="table")
            fast = replay(prep, policy, slots, partition, engine="fast")
            assert fast.engine != "table"
            assert fast.stats.to_dict() == table.stats.to_dict(), \
                (policy, partition, slots, prep.trace.experts.tolist())
            bypassed += table.total.bypasses
    assert bypassed > 0  # the prompt steps wider than the cache were exercised


@pytest.mark.parametrize("partition", ["global", "per-layer"])
def test_lru_all_sizes_on_batched_traces(partition):
    # The one-pass stack distances hold only for caches at least as wide as every step;
    # smaller sizes fall back to the exact kernel. Both must equal the table.
    rng = np.random.default_rng(21)
    engines = set()
    for _ in range(25):
        prep = Prepared(batched_trace(rng))
        for r in lru_all_sizes(prep, sizes(prep, partition), partition):
            table = replay(prep, "lru", r.slots, partition, engine="table")
            assert r.stats.to_dict() == table.stats.to_dict(), (partition, r.slots)
            engines.add(r.engine)
    assert engines == {"lru-stack", "lru-kernel"}


def test_sim_cli_reproduces_a_recorded_live_run(tmp_path):
    """Record a tiny model with a 9-token prompt and 6 decode steps through the cache,
    save the trace, and replay it with ``expertcache sim``: the same hits and misses."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tiny_moe import tiny_model

    from expertcache.cli import main
    from expertcache.integrations.transformers import offload
    from expertcache.trace.format import save_trace
    from expertcache.integrations.record import record

    plain = tiny_model("qwen3_moe", layers=3, experts=16, top_k=2)
    ids = torch.randint(2, 96, (1, 9), generator=torch.Generator().manual_seed(3))
    for config in (dict(slots=6, eviction="lru", partition="global"),
                   dict(slots=9, eviction="slru", partition="per-layer")):
        live = offload(copy.deepcopy(plain), **config)
        trace = record(live, ids, 7)
        assert trace.meta["prefill_steps"] == "batched" and (trace.phases == 0).sum() == 9
        path = save_trace(trace, tmp_path / "rec.npz")
        out = tmp_path / "sim.json"
        assert main(["sim", str(path), "--policy", config["eviction"], "--slots",
                     str(config["slots"]), "--partition", config["partition"], "--json", str(out)]) == 0
        row = json.loads(out.read_text())["results"][0]
        observed = live.expertcache.stats()
        assert row["engine"] != "table"  # a kernel ran the batched prompt
        assert (row["hits"], row["misses"]) == (observed.total().hits, observed.total().misses)
        for name, phase in (("prefill", 0), ("decode", 1)):
            assert row[name] == observed.total(phase).to_dict(), (config, name)
        assert observed.total(0).bypasses > 0 or observed.total(0).evictions > 0
        # The token-by-token order would not match: the prompt's steps differ.
        assert main(["sim", str(path), "--policy", config["eviction"], "--slots",
                     str(config["slots"]), "--partition", config["partition"], "--steps", "token",
                     "--json", str(out)]) == 0
        assert json.loads(out.read_text())["results"][0]["prefill"]["accesses"] \
            > observed.total(0).accesses
