"""``expertcache sim --imatrix``: the plan pinned or seeded before each replay."""

from __future__ import annotations

import json

import numpy as np

from expertcache import SlotTable
from expertcache.cli import main
from expertcache.imatrix import apply_imatrix, table_plan, trace_counts
from expertcache.trace import Trace, save_trace


def flood_trace(T=300, E=304):
    """One layer, top-2: one of 4 hot experts plus a never-repeating cold one per token."""
    rng = np.random.default_rng(1)
    experts = np.stack([rng.integers(0, 4, T), 4 + np.arange(T)], axis=1)[None].astype(np.int16)
    return Trace(experts, {"model": "flood", "num_experts": E, "top_k": 2, "n_moe_layers": 1})


def direct_hit_rate(trace, slots, mode):
    table = SlotTable(1, trace.num_experts, slots, top_k=2)
    apply_imatrix(table, table_plan(trace_counts(trace), table, mode), mode)
    for token in trace.experts[0].tolist():
        table.step(0, token)
    return table.stats().total().hit_rate


def test_sim_cli_pins_and_seeds_the_plan(tmp_path, capsys):
    trace = flood_trace()
    path = save_trace(trace, tmp_path / "flood.npz")
    rates = {}
    for mode in ("pin", "seed", None):
        out = tmp_path / f"{mode}.json"
        extra = ["--imatrix", str(path), "--imatrix-mode", mode] if mode else []
        assert main(["sim", str(path), "--policy", "lru", "--slots", "6", "--json", str(out), *extra]) == 0
        result = json.loads(out.read_text())["results"][0]
        rates[mode] = result["hit_rate"]
        if mode:
            assert result["label"] == f"lru {mode}={3 if mode == 'pin' else 6}"
            assert result["hit_rate"] == direct_hit_rate(trace, 6, mode)
    assert rates["pin"] > rates[None] + 0.1   # the scan cannot flush pinned hot experts
    capsys.readouterr()


def test_sim_cli_refuses_a_plan_that_starves_the_pool(tmp_path, capsys):
    path = save_trace(flood_trace(), tmp_path / "flood.npz")
    assert main(["sim", str(path), "--policy", "lru", "--slots", "6", "--imatrix", str(path),
                 "--imatrix-slots", "5"]) == 2
    assert "leave top_k=2" in capsys.readouterr().err
