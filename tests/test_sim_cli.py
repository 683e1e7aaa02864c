"""``expertcache sim`` end to end: the reference figures of ../shared/traces/README.md
through the JSON output, the schema, the plot, and one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import shared_trace  # tests/ is on sys.path (not a package)
from png_check import pixels, width_of

from expertcache.cli import main
from expertcache.trace import Trace, save_trace

# (trace, partition) -> {(policy, slots): hit rate}, from ../shared/traces/README.md
REFERENCE = {
    ("code", "global"): {("lru", 768): 0.6297, ("belady", 768): 0.8173,
                         ("lru", 1536): 0.8467, ("belady", 1536): 0.9322},
    ("code", "per-layer"): {("lru", 768): 0.6568, ("belady", 768): 0.7746,
                            ("lru", 1536): 0.8448, ("belady", 1536): 0.9182},
    ("general", "global"): {("lru", 768): 0.5697, ("belady", 768): 0.7757,
                            ("lru", 1536): 0.7848, ("belady", 1536): 0.9060},
    ("general", "per-layer"): {("lru", 768): 0.6019, ("belady", 768): 0.7322,
                               ("lru", 1536): 0.7866, ("belady", 1536): 0.8895},
}
FIELDS = {"policy", "admission", "partition", "slots", "accesses", "hits", "misses", "hit_rate",
          "opt_misses", "bytes_moved", "predicted_tok_s"}


@pytest.mark.parametrize("case", sorted(REFERENCE), ids="-".join)
def test_reference_figures_through_the_cli(case, tmp_path):
    name, partition = case
    path = shared_trace(f"qwen3-30b-a3b-{name}.npz")
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    argv = [str(path), "--policy", "lru,belady", "--fraction", "0.125,0.25",
            "--partition", partition, "--json", str(out)]
    if case == ("code", "global"):  # the "done when" command, plot included
        argv += ["--plot", str(png)]
    assert main(["sim", *argv]) == 0
    doc = json.loads(out.read_text())
    assert doc["trace"]["layers"] == 48 and doc["trace"]["tokens"] == 8000
    got = {(r["policy"], r["slots"]): round(r["hit_rate"], 4) for r in doc["results"]}
    assert got == REFERENCE[case]
    for r in doc["results"]:
        assert FIELDS <= set(r) and r["accesses"] == 48 * 8000 * 8
        assert r["bytes_moved"] is None and r["predicted_tok_s"] is None  # size unknown
        # opt is MIN with bypass's, below forced Belady's too: bypass saves misses here
        assert r["opt_misses"] < r["misses"]
    if png.exists() or case == ("code", "global"):
        assert width_of(pixels(png, (840, 540)), "tab:blue") > 0.15  # lru's curve


@pytest.fixture
def small_trace(tmp_path):
    rng = np.random.default_rng(4)
    ex = rng.integers(0, 16, size=(4, 60, 2)).astype(np.int16)
    ex[:, :, 1] = (ex[:, :, 0] + 1 + rng.integers(0, 15, size=(4, 60))) % 16  # distinct pair
    phase = (np.arange(60) >= 10).astype(np.uint8)
    meta = {"model": "tiny", "num_experts": 16, "top_k": 2, "n_moe_layers": 4,
            "expert_bytes": 1_000_000}
    return save_trace(Trace(ex, meta, phase=phase), tmp_path / "tiny.npz")


def test_json_schema_with_known_expert_size(small_trace, tmp_path, capsys):
    out = tmp_path / "o.json"
    assert main(["sim", str(small_trace), "--policy", "default,slru+second-hit", "--slots", "8,16",
                 "--hardware", "h200", "--json", str(out), "--tokens", "50"]) == 0
    doc = json.loads(out.read_text())
    assert doc["trace"]["tokens"] == 50 and doc["cost_model"]["hardware"] == "h200"
    rows = doc["results"]
    assert [(r["admission"], r["slots"]) for r in rows] == [  # default runs its own admission, freq
        ("freq", 8), ("freq", 16), ("second-hit", 8), ("second-hit", 16)]
    for r in rows:
        assert r["accesses"] == 4 * 50 * 2 and r["hits"] + r["misses"] == r["accesses"]
        loads = r["prefill"]["loads"] + r["decode"]["loads"]
        # Fetch path: every miss crosses PCIe; CPU path: only admitted keys are copied.
        expected = r["misses"] if doc["cost_model"]["miss_path_used"] == "fetch" else loads
        assert r["bytes_moved"] == expected * 1_000_000
        assert r["predicted_tok_s"] > 0 and r["opt_misses"] <= r["misses"] + r["decode"]["bypasses"]
        assert r["prefill"]["accesses"] == 4 * 10 * 2
    # More slots: fewer misses, more predicted tokens per second.
    assert rows[1]["misses"] < rows[0]["misses"]
    assert rows[1]["predicted_tok_s"] > rows[0]["predicted_tok_s"]
    assert "default" in capsys.readouterr().out


def test_sweep_draws_a_curve(small_trace, tmp_path):
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    assert main(["sim", str(small_trace), "--policy", "lru,fifo", "--sweep", "4",
                 "--partition", "per-layer", "--json", str(out), "--plot", str(png)]) == 0
    slots = [r["slots"] for r in json.loads(out.read_text())["results"]]
    assert slots == [8, 28, 44, 64] * 2  # per layer: 2, 7, 11, 16 of 16 experts
    rgb = pixels(png, (840, 540))
    assert width_of(rgb, "tab:blue") > 0.15 and width_of(rgb, "tab:orange") > 0.15  # lru, fifo


@pytest.mark.parametrize("argv, message", [
    (["--policy", "nosuch"], "unknown eviction policy 'nosuch'; known eviction policies: .*lru"),
    (["--fraction", "1.5"], r"fraction must be between 0 and 1.*got 1.5"),
    (["--fraction", "0"], r"the share in \(0, 1\] .*got 0.0"),
    (["--slots", "1"], "capacity below top-k"),
    (["--slots", "4", "--partition", "per-layer"], "leaves no slot per layer|below top-k"),
    (["--slots", "8,x"], "--slots takes comma-separated ints"),
    (["--hardware", "toaster"], "unknown hardware 'toaster'"),
])
def test_errors_are_one_clean_line(small_trace, capsys, argv, message):
    import re

    assert main(["sim", str(small_trace), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and re.search(message, err), err


def test_missing_trace_file(tmp_path, capsys):
    assert main(["sim", str(tmp_path / "none.npz"), "--slots", "8"]) == 2
    assert "trace file not found" in capsys.readouterr().err


def test_synthetic_trace_source(tmp_path, monkeypatch, small_trace):
    # 'synth:NAME' goes to trace.synth.synth_trace(NAME, tokens, seed=...); the
    # generator itself is tested with its own module, so a stand-in is enough here.
    synth = pytest.importorskip("expertcache.trace.synth", reason="trace/synth.py not in this checkout")
    from expertcache.trace import load_trace

    calls = []

    def fake(name, tokens, seed=0):
        calls.append((name, tokens, seed))
        return load_trace(small_trace)
    monkeypatch.setattr(synth, "synth_trace", fake)
    out = tmp_path / "syn.json"
    assert main(["sim", "synth:olmoe", "--tokens", "40", "--seed", "3", "--policy", "lru",
                 "--fraction", "0.25", "--json", str(out)]) == 0
    assert calls == [("olmoe", 40, 3)]
    doc = json.loads(out.read_text())
    assert doc["trace"]["tokens"] == 40 and doc["results"][0]["accesses"] == 4 * 40 * 2


def test_probe_profile_feeds_sim(small_trace, tmp_path, capsys):
    profile, out = tmp_path / "hw.json", tmp_path / "o.json"
    assert main(["probe", "-o", str(profile), "--seconds", "0.02", "--base", "pcie5-consumer"]) == 0
    data = json.loads(profile.read_text())
    assert {"cpu_gflops", "cpu_mem_gbps"} <= set(data["measured"]) and data["base"] == "pcie5-consumer"
    assert main(["sim", str(small_trace), "--policy", "lru", "--slots", "8", "--hardware", str(profile),
                 "--miss-path", "cpu", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["cost_model"]["hardware"] == "probed" and doc["results"][0]["predicted_tok_s"] > 0
    assert main(["probe", "--seconds", "0"]) == 2
    assert "--seconds must be positive" in capsys.readouterr().err


def test_help_imports_only_what_it_needs():
    # `expertcache --help` lists the commands without importing their modules, so it pays
    # for none of numpy, numba, matplotlib, rich or torch (it takes well under 0.3 s).
    import subprocess
    import sys

    code = ("import sys; from expertcache.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "heavy = ('numpy', 'numba', 'matplotlib', 'rich', 'torch')\n"
            "print(sorted(m for m in heavy if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert "sim" in out.stdout and "replay a routing trace" in out.stdout


def test_a_subcommand_builds_only_its_own_parser():
    from expertcache.cli import build_parser

    args = build_parser(["policies", "--json"]).parse_args(["policies", "--json"])
    assert args.command == "policies" and args.json
