"""``benchmarks/bench_tiers.py``'s scoring (decode-only disk bytes, the bracketing references) and model files."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_tiers.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_tiers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_references_before_and_after_a_round_score_as_their_mean(bench):
    ref = bench._bracket({"tok_s": 60.0, "tokens": [1, 2]}, {"tok_s": 40.0, "tokens": [1, 2]})
    assert ref["tok_s"] == 50.0 and (ref["tok_s_before"], ref["tok_s_after"]) == (60.0, 40.0)
    assert bench._bracket({"error": "exit 1"}, {"tok_s": 40.0, "tokens": [1]})["tok_s"] == 40.0
    with pytest.raises(SystemExit, match="different tokens"):
        bench._bracket({"tok_s": 1.0, "tokens": [1]}, {"tok_s": 1.0, "tokens": [2]})


def test_disk_bytes_per_token_count_the_decode_forwards_only(bench):
    run = {"decode_disk_read_bytes": 10 << 20, "disk_read_bytes": 30 << 20, "decode_tokens": 10,
           "tok_s": 40.0, "tokens": [1], "tier": None}
    bench._score(run, {"tok_s": 50.0, "tokens": [1]}, bandwidth=2 << 20)   # 2 MiB/s: 2 tok/s on disk
    assert run["disk_bytes_per_token"] == 1 << 20 and run["all_disk_bytes_per_token"] == 3 << 20
    assert run["disk_bound_tok_s"] == 2.0 and run["bound_tok_s"] == 2.0 and run["of_bound"] == 20.0
    assert run["tokens_equal_reference"] and run["ram_hit_rate"] is None


def test_past_the_first_quarter_scores_its_own_disk_bytes_against_the_references_steady_speed(bench):
    ref = bench._bracket({"tok_s": 60.0, "steady_tok_s": 64.0, "tokens": [1]},
                         {"tok_s": 50.0, "steady_tok_s": 56.0, "tokens": [1]})
    assert ref["steady_tok_s"] == 60.0
    run = {"decode_disk_read_bytes": 10 << 20, "disk_read_bytes": 10 << 20, "decode_tokens": 10,
           "steady_disk_read_bytes": 2 << 20, "steady_tokens": 4,
           "tok_s": 33.0, "steady_tok_s": 45.0, "tokens": [1], "tier": None}
    bench._score(run, ref, bandwidth=100 << 20)   # disk bounds 100 and 200 tok/s: above all-in-RAM
    assert run["of_bound"] == 33.0 / 55.0 and run["of_bound_steady"] == 45.0 / 60.0
    slow_disk = dict(run)
    bench._score(slow_disk, ref, bandwidth=10 << 20)   # 10 tok/s over the decode, 20 past its quarter
    assert slow_disk["of_bound"] == 33.0 / 10.0 and slow_disk["of_bound_steady"] == 45.0 / 20.0
    short = {**run, "steady_tok_s": None}               # a run too short for a steady part
    bench._score(short, ref, bandwidth=100 << 20)
    assert short["of_bound_steady"] is None


def test_the_serial_bound_adds_the_disk_time_to_the_all_in_ram_time(bench):
    run = {"decode_disk_read_bytes": 10 << 20, "disk_read_bytes": 10 << 20, "decode_tokens": 10,
           "tok_s": 30.0, "tokens": [1], "tier": None}
    bench._score(run, {"tok_s": 50.0, "tokens": [1]}, bandwidth=50 << 20)  # 1 MiB a token: 20 ms + 20 ms
    assert run["serial_bound_tok_s"] == pytest.approx(25.0) and run["of_serial_bound"] == pytest.approx(1.2)
    assert run["of_bound"] == pytest.approx(0.6)                            # min(50, 50) tok/s
    no_reads = {**run, "decode_disk_read_bytes": 0}                         # all in RAM: no disk time
    bench._score(no_reads, {"tok_s": 50.0, "tokens": [1]}, bandwidth=50 << 20)
    assert no_reads["serial_bound_tok_s"] == 50.0 and no_reads["of_serial_bound"] == 0.6
    no_ref = dict(run)
    bench._score(no_ref, {"error": "exit 1"}, bandwidth=50 << 20)
    assert no_ref["serial_bound_tok_s"] is None and no_ref["of_serial_bound"] is None


def test_runs_on_plain_kernels_are_checked_against_plain_kernels_tokens(bench):
    run = {"decode_disk_read_bytes": 0, "disk_read_bytes": 0, "decode_tokens": 10, "tok_s": 30.0,
           "tokens": [1, 2, 3], "tier": None}
    repacked, plain = {"tok_s": 50.0, "tokens": [1, 2, 4]}, {"tok_s": 45.0, "tokens": [1, 2, 3]}
    bench._score(run, repacked, bandwidth=1 << 20, same_kernels=plain)
    assert run["tokens_equal_reference"] and run["tokens_reference"] == "all in RAM, plain kernels"
    assert run["of_bound"] == 30.0 / 50.0                       # the speed still against the round's reference
    bench._score(run, repacked, bandwidth=1 << 20)
    assert not run["tokens_equal_reference"] and run["tokens_reference"] == "all in RAM"


def test_model_files_keep_the_default_name_and_name_each_knob(bench):
    """Runs of earlier sessions named these files: the default and --layer-update names must not move."""
    folder = Path("d")
    assert bench.model_path(folder) == folder / "qwen3moe-q4_0-tiers.gguf"
    assert bench.model_path(folder, 0.3).name == "qwen3moe-q4_0-tiers-update0.3.gguf"
    assert bench.model_path(folder, 0.01, 2).name == "qwen3moe-q4_0-tiers-update0.01-shared2.gguf"
    assert bench.model_path(folder, 1, 1.5).name == "qwen3moe-q4_0-tiers-shared1.5.gguf"
