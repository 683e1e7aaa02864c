"""``expertcache trace batch``: B requests interleaved into a grouped trace, with and without
prompt chunks mixed into the decode steps."""

from __future__ import annotations

import numpy as np
import pytest

from expertcache.cli import main
from expertcache.sim.replay import replay
from expertcache.stats import DECODE, PREFILL
from expertcache.trace import load_trace
from expertcache.trace.batch import batch_traces, schedule
from expertcache.trace.format import Trace


def numbered(T: int, L: int = 2, E: int = 64, K: int = 1) -> Trace:
    """Token t routes to expert t % E at every layer: each token recognisable."""
    ex = np.tile((np.arange(T) % E).astype(np.int16)[None, :, None], (L, 1, K))
    return Trace(ex, {"num_experts": E, "top_k": K, "n_moe_layers": L})


def test_one_trace_cut_into_interleaved_stretches():
    out = batch_traces([numbered(12)], 3)
    assert out.meta["prefill_steps"] == "grouped" and out.meta["step_tokens"] == [3] * 4
    # step s holds token s of each stretch: 0, 4, 8, then 1, 5, 9, ...
    assert out.experts[0, :6, 0].tolist() == [0, 4, 8, 1, 5, 9]
    assert (out.phases == DECODE).all()


def test_several_traces_share_the_requests():
    a, b = numbered(8), numbered(6)
    b.experts += 32
    out = batch_traces([a, b], 3)          # a gives 2 stretches of 4, b one of 6
    assert out.meta["step_tokens"] == [3, 3, 3, 3, 1, 1]
    assert out.experts[0, :3, 0].tolist() == [0, 4, 32]


def test_prompt_chunks_are_mixed_into_decode_steps():
    # 2 requests, prompts of 4 tokens prefilled 2 per step: request 1 starts decoding while
    # request 2's prompt is prefilled.
    steps = schedule([6, 6], prompt=4, chunk=2)
    assert steps[:4] == [[(0, 0), (0, 1)], [(0, 2), (0, 3)], [(0, 4), (1, 0), (1, 1)],
                         [(0, 5), (1, 2), (1, 3)]]
    out = batch_traces([numbered(12)], 2, prompt=4, prompt_chunk=2)
    assert sum(out.meta["step_tokens"]) == 12
    assert (out.phases == PREFILL).sum() == 8
    assert replay(out, "lru", 8, "global").stats.total(PREFILL).accesses > 0


@pytest.mark.parametrize("kwargs, words", [({"requests": 5}, "too few"),
                                           ({"requests": 0}, "at least 1"),
                                           ({"requests": 2, "prompt": 2}, "no token to decode")])
def test_bad_input(kwargs, words):
    with pytest.raises(ValueError, match=words):
        batch_traces([numbered(4)], **kwargs)


def test_cli_writes_a_trace_sim_replays(tmp_path, capsys):
    src = tmp_path / "in.npz"
    from expertcache.trace import save_trace
    save_trace(numbered(40), src)
    out = tmp_path / "b4.npz"
    assert main(["trace", "batch", str(src), "--requests", "4", "-o", str(out)]) == 0
    trace = load_trace(out)
    assert trace.meta["step_tokens"] == [4] * 10
    cut = trace.slice_tokens(10)           # a grouped trace cut keeps whole and partial steps
    assert cut.meta["step_tokens"] == [4, 4, 2]
    assert main(["sim", str(out), "--slots", "8", "--policy", "lru,belady+oracle"]) == 0
    assert "belady+oracle" in capsys.readouterr().out


def test_sim_opt_misses_is_the_lower_optimum(tmp_path):
    # Batched random routing with few slots: bypass beats forced admission, and opt_misses
    # (every row's 'x opt') is MIN with bypass's, while forced Belady stays by name.
    import json
    from expertcache.trace import save_trace
    rng = np.random.default_rng(0)
    ex = np.stack([[rng.choice(16, 2, replace=False) for _ in range(200)] for _ in range(3)])
    src = tmp_path / "r.npz"
    save_trace(Trace(ex.astype(np.int16), {"num_experts": 16, "top_k": 2, "n_moe_layers": 3}), src)
    out = tmp_path / "b.npz"
    assert main(["trace", "batch", str(src), "--requests", "4", "-o", str(out)]) == 0
    js = tmp_path / "r.json"
    assert main(["sim", str(out), "--slots", "12", "--policy", "lru,belady", "--json", str(js)]) == 0
    rows = {r["label"]: r for r in json.loads(js.read_text())["results"]}
    bypass = replay(load_trace(out), "belady+oracle", 12, "global").misses
    assert bypass < rows["belady"]["misses"]
    assert rows["lru"]["opt_misses"] == rows["belady"]["opt_misses"] == bypass
