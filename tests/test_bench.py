"""The decode benchmark: byte accounting, equality with the simulator, identical outputs.

A tiny Qwen3-shaped model (scale 0.03: hidden 64, expert FF 16, fp32) on the CPU keeps
every test to a second or two while running the real runtime code paths.
"""

from __future__ import annotations

import json

import pytest
import torch

from expertcache.bench.live import Inputs, build_cache, run_strategy
from expertcache.bench.model import BenchShape, experts_module, host_experts
from expertcache.decode_phases import bounds, ms_per_token, steady_blocks
from expertcache.bench.report import document, predicted_ms, row, verdict
from expertcache.bench.run import run_strategies
from expertcache.bench.strategies import Strategy, plan
from expertcache.bench.workload import cut, load_workload
from expertcache.cli import main
from expertcache.presets import preset
from expertcache.costmodel import Hardware
from expertcache.sim.replay import replay
from expertcache.stats import DECODE
from expertcache.trace.synth import synth_trace
from png_check import pixels, width_of  # tests/ is on sys.path (not a package)

LAYERS, TOKENS, SCALE = 3, 48, 0.03


@pytest.fixture(scope="module")
def trace():
    # 8 prompt tokens: prefill steps must stay out of the per-decode-token figures
    return cut(synth_trace("qwen3-30b-a3b", TOKENS, seed=3, prompt=8), LAYERS, None)


@pytest.fixture(scope="module")
def result(trace):
    strategies = plan(["lru", "fifo", "slru+second-hit"], [48, 96])  # admission: bypasses copy too
    return run_strategies(trace, preset("qwen3-30b-a3b"), strategies, scale=SCALE, dtype="fp32",
                          device="cpu", hardware=None, threads=1)


def runs_by(result, kind, slots=None, policy=None):
    return [r for r in result.runs if r.strategy.kind == kind
            and (slots is None or r.strategy.slots == slots)
            and (policy is None or r.strategy.eviction == policy)]


def test_copy_every_pass_moves_every_routed_expert(result, trace):
    run, = runs_by(result, "copy-every-pass")
    decode_tokens = int((trace.phases == DECODE).sum())
    L, k, nbytes = trace.num_layers, trace.top_k, result.shape.expert_bytes
    assert len(run.seconds) == decode_tokens == TOKENS - 8
    assert run.h2d_decode == decode_tokens * L * k * nbytes
    assert run.decode.hits == 0 and run.decode.misses == decode_tokens * L * k


def test_cache_moves_its_misses_and_matches_sim(result, trace):
    nbytes = result.shape.expert_bytes
    for run in runs_by(result, "cache") + runs_by(result, "belady"):
        s = run.strategy
        assert run.h2d_decode == run.decode.misses * nbytes, s.title
        sim = replay(trace, s.sim_policy, s.slots, "global").stats.total(DECODE)
        assert (run.decode.hits, run.decode.misses) == (sim.hits, sim.misses), s.title
        assert 0 < run.decode.hits < run.decode.accesses, s.title  # a real mix, not a degenerate case


def test_baselines_count_as_they_should(result):
    resident, = runs_by(result, "resident")
    cpu, = runs_by(result, "cpu")
    assert resident.decode.misses == 0 and resident.h2d_decode == 0
    assert resident.slot_bytes == LAYERS * 128 * result.shape.expert_bytes
    assert cpu.decode.hits == 0 and cpu.h2d_decode == 0 and cpu.slot_bytes == 0


def test_belady_is_the_limit(result):
    for slots in (48, 96):
        opt, = runs_by(result, "belady", slots)
        for run in runs_by(result, "cache", slots):
            assert opt.decode.misses <= run.decode.misses


def test_every_strategy_computes_the_same_outputs(result):
    """The bench cannot be fast by being wrong: same final hidden vector per token as resident."""
    ref, = runs_by(result, "resident")
    assert ref.outputs.shape == (TOKENS - 8, result.shape.hidden)
    assert torch.isfinite(ref.outputs).all() and ref.outputs.abs().max() > 0.1
    for run in result.runs:
        if run.strategy.kind == "cpu":  # host matmul per expert: same math, other summation order
            torch.testing.assert_close(run.outputs, ref.outputs, rtol=1e-5, atol=1e-5)
        else:  # every pool strategy runs the same grouped matmul: bit for bit
            assert torch.equal(run.outputs, ref.outputs), run.strategy.title


def test_self_checks_pass_and_catch_a_wrong_figure(result):
    from dataclasses import replace as dc_replace
    from expertcache.bench.checks import run_checks, summary
    checks = run_checks(result)
    assert checks["ok"] and checks["reference"] == "resident", checks
    assert set(checks["outputs_max_abs_diff"]) == {r.strategy.title for r in result.runs}
    assert summary(checks).startswith("checks: H2D bytes add up")
    bad = list(result.runs)
    i = next(j for j, r in enumerate(bad) if r.strategy.kind == "cache")
    bad[i] = dc_replace(bad[i], decode=dc_replace(bad[i].decode, hits=bad[i].decode.hits + 1),
                        outputs=bad[i].outputs + 1.0)
    broken = run_checks(dc_replace(result, runs=bad))
    assert not broken["ok"] and len(broken["sim"]) == 1 and broken["outputs_mismatch"] == [bad[i].strategy.title]
    assert summary(broken).startswith("CHECKS FAILED")


def test_a_stale_slot_would_be_caught(trace):
    """Corrupt one cached expert's slot: the output check must see it."""
    shape = BenchShape.from_preset(preset("qwen3-30b-a3b"), LAYERS, SCALE, "fp32")
    module, hosts = experts_module(shape), host_experts(shape)
    inputs = Inputs(trace, shape.hidden, shape.torch_dtype, torch.device("cpu"))
    good = run_strategy(build_cache(Strategy("resident"), hosts, 8, torch.device("cpu"), "global"),
                        Strategy("resident"), module, inputs)
    cache = build_cache(Strategy("resident"), hosts, 8, torch.device("cpu"), "global")
    used = int(trace.experts[1, -1, 0])  # layer 1's first expert of the last token
    cache.pool.tensors["down_proj"][cache.table.slot_of(128 + used)].mul_(1.5)
    bad = run_strategy(cache, Strategy("resident"), module, inputs)
    assert not torch.allclose(bad.outputs[-1], good.outputs[-1], rtol=1e-3, atol=1e-3)


def test_phases_split_decode_tokens():
    assert bounds(100) == {"cold": range(0, 16), "warm": range(16, 25), "steady": range(25, 100)}
    assert bounds(40)["warm"] == range(16, 16) and bounds(40)["steady"] == range(16, 40)
    assert bounds(8) == {"cold": range(0, 8), "warm": range(8, 8), "steady": range(8, 8)}
    ms = ms_per_token([0.002] * 16 + [0.001] * 84)
    assert ms["cold"] == pytest.approx(2.0) and ms["steady"] == pytest.approx(1.0)
    assert ms_per_token([0.001] * 8)["steady"] is None


def test_json_rows_follow_the_documented_schema(result):
    doc = document(result, [row(r, result) for r in result.runs])
    for key in ("model", "layers", "top_k", "num_experts", "expert_bytes", "tokens", "device", "results"):
        assert key in doc
    assert doc["tokens"] == TOKENS - 8 and doc["layers"] == LAYERS and doc["device"] == "cpu"
    assert doc["clock"] == "cpu"  # one torch thread on the CPU: the thread's CPU time
    assert doc["machine"]["cores"] >= 1 and doc["machine"]["cpu"]
    for r in doc["results"]:
        for key in ("strategy", "policy", "slots", "accesses", "hits", "misses", "hit_rate",
                    "h2d_bytes_per_token", "slot_bytes", "ms_per_token"):
            assert key in r
        assert set(r["ms_per_token"]) == {"cold", "warm", "steady"}
        assert r["ms_per_token"]["steady"] > 0 and r["wall_ms_per_token"]["steady"] > 0
        assert 0 <= r["overhead_share"] < 1 and r["steady_breakdown_ms"]["compute"] > 0
    cep = next(r for r in doc["results"] if r["strategy"] == "copy-every-pass")
    assert cep["h2d_bytes_per_token"] == LAYERS * 8 * doc["expert_bytes"]
    json.dumps(doc)  # serialisable as is
    assert "Fastest in steady state" in verdict(doc["results"])


def test_steady_blocks_split_the_steady_phase():
    # 100 tokens: steady is 25..99 (75 tokens) -> blocks of 19, 19, 18, 19 tokens
    seconds = [1.0] * 25 + [0.001] * 19 + [0.002] * 19 + [0.003] * 18 + [0.004] * 19
    assert steady_blocks(seconds) == pytest.approx([1.0, 2.0, 3.0, 4.0])
    assert steady_blocks([0.001] * 17) == pytest.approx([1.0])  # one steady token: one block
    assert steady_blocks([0.001] * 8) == []                     # no steady phase


def _row(strategy, tok_s, blocks, policy=None, slots=0):
    return {"strategy": strategy, "policy": policy, "slots": slots, "tok_s": tok_s,
            "steady_tok_s_blocks": blocks, "steady_hit_rate": 0.8, "slot_bytes": 2**20}


def test_verdict_calls_a_winner_only_beyond_the_spread():
    clear = [_row("resident", 26.4, [26.0, 26.8]), _row("copy-every-pass", 13.2, [13.0, 13.4]),
             _row("cpu", 20.0, [19.5, 20.5])]
    text = verdict(clear)
    assert text.startswith("Fastest in steady state: resident at 26.4 tok/s")
    assert "2.00x the speed of copy-every-pass" in text and "1.32x the speed of cpu" in text
    # resident and cpu overlap: a tie, named in table order whichever mean is higher
    for cpu in (26.5, 26.3):
        text = verdict([clear[0], clear[1], _row("cpu", cpu, [25.9, 26.9])])
        assert text.startswith("Fastest in steady state, tied within the spread of their timing "
                               f"blocks: resident 26.4, cpu {cpu:.1f} tok/s"), text
        assert "the speed of cpu" not in text and "the speed of copy-every-pass" in text
    cache = _row("cache", 14.0, [12.9, 15.1], "lru", 64)
    text = verdict(clear + [cache])
    assert "ran 1.06x copy-every-pass (within the spread: no measured difference)." in text
    assert "blocks differed by up to 16% of its tok/s" in text  # the cache's (15.1 - 12.9) / 14
    assert "busy machine" not in text
    assert "busy machine" in verdict(clear + [_row("cache", 14.0, [10.0, 15.1], "lru", 64)])


def test_cost_model_prediction_per_strategy(result):
    """Each strategy maps to the cost model's hits/misses and miss path as documented."""
    hw = Hardware("t", h2d_gbps=1, gpu_mem_gbps=2, cpu_mem_gbps=4, cpu_gflops=1e6,
                  transfer_latency_s=0, layer_overhead_s=1e-4)
    shape, b = result.shape, result.shape.expert_bytes
    n = LAYERS * 8  # expert uses per token
    expect = {"resident": n * b / 2e9, "copy-every-pass": n * (b / 1e9 + b / 2e9), "cpu": n * b / 4e9}
    for kind, seconds in expect.items():
        run, = runs_by(result, kind)
        assert predicted_ms(run, shape, hw) == pytest.approx(1e3 * (seconds + LAYERS * 1e-4))
    # copy-every-pass takes the staging profile when one is given (copies into hot staging slots)
    staging = Hardware("s", h2d_gbps=4, gpu_mem_gbps=2, cpu_mem_gbps=4, cpu_gflops=1e6,
                       transfer_latency_s=0, layer_overhead_s=1e-4)
    run, = runs_by(result, "copy-every-pass")
    assert predicted_ms(run, shape, hw, staging) == pytest.approx(
        1e3 * (n * (b / 4e9 + b / 2e9) + LAYERS * 1e-4))
    run = runs_by(result, "cache", 96, "lru")[0]
    tokens = run.steady.accesses / n
    h, m = run.steady.hits / tokens, run.steady.misses / tokens
    assert predicted_ms(run, shape, hw) == pytest.approx(
        1e3 * (h * b / 2e9 + m * (b / 1e9 + b / 2e9) + LAYERS * 1e-4))


def test_cli_bench_writes_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    torch.set_num_threads(2)
    code = main(["bench", "--preset", "olmoe", "--layers", "2", "--tokens", "40", "--scale", "0.03",
                 "--dtype", "fp32", "--policy", "lru", "--slots", "32,64", "--device", "cpu",
                 "--threads", "1", "--json", str(out), "--plot", str(png)])
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["model"] == "olmoe" and doc["num_experts"] == 64 and doc["top_k"] == 8
    assert doc["machine"]["torch_threads"] == 1 and torch.get_num_threads() == 2  # restored after
    kinds = [(r["strategy"], r["slots"]) for r in doc["results"]]
    assert kinds == [("resident", 128), ("copy-every-pass", 0), ("cpu", 0), ("cache", 32),
                     ("cache", 64), ("belady", 32), ("belady", 64)]
    assert all(r["predicted_ms_per_token"] > 0 for r in doc["results"])  # calibrated here
    rgb = pixels(png, (840, 540))  # figsize 7 x 4.5 inches at 120 dpi
    assert width_of(rgb, "tab:blue") > 0.15, "no lru line across the plot"
    for colour in ("tab:green", "tab:red", "tab:gray"):  # 3 baselines: drawn (their extent varies with timing)
        assert width_of(rgb, colour) > 0, f"no {colour} baseline drawn"
    text = capsys.readouterr().out
    assert "Fastest in steady state" in text and "checks: H2D bytes add up" in text
    assert "planner: host (each step's routing is read back" in text  # which planner was timed
    assert doc["checks"]["ok"] and doc["checks"]["sim"] == []


@pytest.mark.parametrize("argv, words", [
    (["--preset", "olmoe", "--layers", "99"], "exceeds"),
    (["--preset", "olmoe", "--slots", "4"], "top-k"),
    (["--preset", "olmoe", "--policy", "nosuch"], "nosuch"),
    (["--preset", "nosuch"], "known presets"),
    (["--preset", "olmoe", "--scale", "0"], "--scale"),
    (["--preset", "olmoe", "--device", "tpu"], "--device"),
    (["--preset", "olmoe", "--tokens", "0"], "--tokens"),
    (["--preset", "olmoe", "--baselines", "gpu"], "unknown baseline"),
    (["--preset", "olmoe", "--device", "cpu", "--threads", "2", "--clock", "cpu"], "--threads 1"),
])
def test_cli_bench_bad_input(argv, words, capsys):
    code = main(["bench", "--layers", "2", "--tokens", "20", "--scale", "0.03", "--dtype", "fp32",
                 "--hardware", "none", *argv])
    err = capsys.readouterr().err
    assert code == 2 and words in err and "Traceback" not in err


def test_trace_needs_a_known_shape(tmp_path):
    from expertcache.trace.format import Trace, save_trace
    import numpy as np
    path = tmp_path / "t.npz"
    save_trace(Trace(np.zeros((2, 4, 2), dtype=np.int16) + np.arange(2, dtype=np.int16),
                     {"model": "mystery", "num_experts": 8, "top_k": 2, "n_moe_layers": 2}), path)
    with pytest.raises(ValueError, match="--preset"):
        load_workload(path)
    with pytest.raises(ValueError, match="matching --preset"):
        load_workload(path, "olmoe")
