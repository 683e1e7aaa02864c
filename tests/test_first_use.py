"""What a new user sees in the batched-trace, lag and planner features (issue 34): each test
checks the printed line or the JSON field. Tiny traces built here; the shared ones only where
a real file matters (skipped with the reason when absent)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from expertcache.cli import main
from expertcache.config import CacheConfig
from expertcache.policies.registry import parse_policy
from expertcache.sim.replay import replay
from expertcache.trace import load_trace, save_trace
from expertcache.trace.batch import batch_traces
from expertcache.trace.format import Trace

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "traces" / "qwen3-30b-a3b-code.npz"


def skewed(T=400, L=3, E=32, K=4, seed=0) -> Trace:
    """Zipf-like routing: a few hot experts per layer, a long tail."""
    rng = np.random.default_rng(seed)
    p = 1 / np.arange(1, E + 1) ** 1.1
    p /= p.sum()
    ex = np.stack([[rng.choice(E, K, replace=False, p=p) for _ in range(T)] for _ in range(L)])
    return Trace(ex.astype(np.int16), {"num_experts": E, "top_k": K, "n_moe_layers": L, "model": "tiny"})


@pytest.fixture(scope="module")
def batched(tmp_path_factory):
    """A 4-request batched trace on disk and its single-stream source."""
    folder = tmp_path_factory.mktemp("first-use")
    single, out = folder / "single.npz", folder / "b4.npz"
    save_trace(skewed(), single)
    assert main(["trace", "batch", str(single), "--requests", "4", "-o", str(out)]) == 0
    return single, out


# -- the default policy's admission ---------------------------------------------------------------
def test_default_runs_and_reports_its_admission_and_a_named_always_wins(batched):
    trace = load_trace(batched[1])
    default, always, plain = (replay(trace, p, 24) for p in ("default", "default+always", "next-use"))
    assert (default.admission, always.admission) == ("freq", "always")
    assert always.misses == plain.misses != default.misses  # '+always' really runs always
    assert (default.label, always.label) == ("default (next-use+freq)", "default (next-use)+always")
    pair = parse_policy("default")
    assert (pair.admission.name, pair.admission.params) == ("freq", {"reset": 16384, "narrow": 0})


def test_sim_json_names_the_rules_that_ran_and_the_batch(batched, tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert main(["sim", str(batched[1]), "--slots", "24", "--policy", "default,default+always",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.splitlines()[0] == ("tiny: 3 layers x 32 experts, top-4, 400 tokens "
                                       "(B = 4 requests decoded together: 100 steps of 4..4 tokens)")
    doc = json.loads(out.read_text())
    first, second = doc["results"]
    assert (first["admission"], first["admission_params"]) == ("freq", {"reset": 16384, "narrow": 0})
    assert (second["admission"], second["admission_params"]) == ("always", {})
    assert first["eviction_params"] == {"window": 128.0, "horizon": 2}
    assert (doc["trace"]["requests"], doc["trace"]["steps"]) == (4, 100)


def test_generate_reports_name_the_admission_that_runs():
    from expertcache.runtime.generate import policy_label
    assert policy_label(CacheConfig(slots=8).to_dict()) == \
        "default:window=128.0:horizon=2+freq:reset=16384:narrow=0"
    assert policy_label(CacheConfig(slots=8, admission="always").to_dict()).endswith("+always")
    cfg = CacheConfig(slots=8, eviction="default", admission="always")
    assert cfg.to_dict()["admission"] == "always"


# -- the planner, the slots, --lag with the host planner -------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tiny_moe import save_checkpoint, tiny_model
    path = tmp_path_factory.mktemp("ckpt")
    save_checkpoint(tiny_model("mixtral"), path)  # 2 layers x 8 experts, top-2
    return path


def _summary_line(printed: str, label: str) -> str:
    return next(line for line in printed.splitlines() if line.startswith(f"{label:<14}"))


def test_generate_names_the_planner_and_the_slots_it_got(checkpoint, tmp_path, capsys):
    js = tmp_path / "g.json"
    assert main(["generate", str(checkpoint), "--prompt", "w1 w2", "--max-new-tokens", "2",
                 "--slots", "100000", "--json", str(js)]) == 0
    printed = capsys.readouterr().out
    assert _summary_line(printed, "planner") == (
        "planner       host (planner='auto': host, decode is not captured here (graphs='auto' on cpu))")
    assert "--slots 100000 asked, 16 used: the model has 16 experts (2 x 8)" in printed
    assert json.loads(js.read_text())["cache"]["config"]["admission"] == "freq"
    # more staging blocks than staging rows: the device planner is refused, and the text says so
    assert main(["generate", str(checkpoint), "--prompt", "w1 w2", "--max-new-tokens", "2",
                 "--slots", "6", "--planner", "device", "--staging-blocks", "4"]) == 0
    line = _summary_line(capsys.readouterr().out, "planner")
    assert line.startswith("planner       host (planner='device' refused, host planner used: "
                           "staging_blocks=4 needs as many staging rows; the pool has 2")


def test_generate_on_a_gguf_says_which_planner_ran(tmp_path, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("gguf")
    from gguf_models import write_gguf
    path = write_gguf(tmp_path / "tiny.gguf", "qwen3_moe", "Q8_0")
    js = tmp_path / "g.json"
    assert main(["generate", str(path), "--prompt", "hello", "--max-new-tokens", "2", "--slots", "8",
                 "--planner", "device", "--json", str(js)]) == 0
    cache = json.loads(js.read_text())["cache"]
    line = _summary_line(capsys.readouterr().out, "planner")
    # whichever planner ran (a GGUF may or may not take the device path), the text names it and why
    assert line == f"planner       {cache['planner']} ({cache['planner_reason']})"
    if cache["planner"] == "host":
        assert "planner='device' refused" in line


def test_serve_names_the_planner(checkpoint, monkeypatch, capsys):
    pytest.importorskip("uvicorn")
    import expertcache.serve.server as server

    class NoServer:  # the model loads as for serving; then return instead of listening
        def __init__(self, *args, **kwargs):
            pass

        def run(self, sock):
            return None

    monkeypatch.setattr(server, "Server", NoServer)
    assert main(["serve", str(checkpoint), "--port", "0", "--slots", "100000"]) == 0
    printed = capsys.readouterr().out
    assert "expertcache serve: planner host (planner='auto': host, decode is not captured" in printed
    assert "expertcache serve: --slots 100000 asked, 16 used" in printed


@pytest.mark.parametrize("flags, words", [
    (["--planner", "host", "--lag", "0"], "--lag applies to --planner device only"),
    (["--lag", "2"], "--lag applies to --planner device only"),
    (["--staging-blocks", "2", "--lag", "1"], "--lag and --staging-blocks apply to --planner device only"),
])
def test_lag_with_the_host_planner_is_refused_in_one_line(tmp_path, flags, words, capsys):
    assert main(["generate", str(tmp_path / "model.gguf"), "--prompt", "x", *flags]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1
    with pytest.raises(ValueError, match="apply to planner='device' only"):
        CacheConfig(slots=8, lag=2)


# -- traces --------------------------------------------------------------------------------------
def test_a_directory_as_a_trace_is_one_line(tmp_path, capsys):
    for argv in (["trace", "batch", str(tmp_path), "--requests", "2", "-o", str(tmp_path / "o.npz")],
                 ["sim", str(tmp_path), "--slots", "8"],
                 ["plan", "qwen3-30b-a3b", "--quant", "Q4_K", "--gpu-memory", "4GiB", "--trace", str(tmp_path)],
                 ["trace", "info", str(tmp_path)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"{tmp_path} is a directory; give a trace file (.npz) in it" in err, argv
        assert len(err.strip().splitlines()) == 1


def test_trace_batch_refusals(batched, tmp_path, capsys):
    single, b4 = batched
    cases = [
        (["--requests", "2", "-o", str(single)], f"-o {single} is an input trace"),
        ([str(b4), "--requests", "2", "-o", str(tmp_path / "x.npz")],
         f"{b4} is already a batched (grouped) trace of 4 requests"),
        (["--requests", "2", "--prompt-chunk", "4", "-o", str(tmp_path / "x.npz")],
         "--prompt-chunk 4 needs --prompt N"),
        (["--requests", "1000000", "-o", str(tmp_path / "x.npz")],
         f"{single} has 400 tokens, too few for 1000000 requests"),
    ]
    for extra, words in cases:
        inputs = [] if extra[0].endswith(".npz") else [str(single)]
        assert main(["trace", "batch", *inputs, *extra]) == 2
        assert words in capsys.readouterr().err, extra
    assert load_trace(single).meta.get("prefill_steps") != "grouped"  # not overwritten


def test_trace_batch_help_says_what_bench_does(capsys):
    with pytest.raises(SystemExit):
        main(["trace", "batch", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "sim and plan replay it as an engine's batches; bench replays any trace one token per step" in text
    docs = " ".join((ROOT / "docs" / "traces.md").read_text().split())
    assert "`bench` does not batch yet: its live path decodes one token per step" in docs


def test_trace_info_summarises_a_batched_trace(batched, capsys):
    assert main(["trace", "info", str(batched[1])]) == 0
    out = capsys.readouterr().out
    assert "steps: 100" in out and "step_tokens: 4..4 tokens a step, mean 4.00" in out
    assert "[4, 4" not in out  # not one number per step
    assert ("lag1_reuse: share of a token's experts the token before it in the file also selected "
            "(chance 0.125); tokens are in step order here") in out


def test_plan_says_what_its_tok_s_is_for_a_batch(batched, tmp_path, capsys):
    js = tmp_path / "plan.json"
    args = ["plan", "qwen3-30b-a3b", "--quant", "Q4_K", "--gpu-memory", "4GiB", "--tokens", "200",
            "--device", "cuda", "--policy", "lru", "--json", str(js)]
    assert main([*args, "--requests", "4"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert ("cut into 4 requests decoded together; 48 layers x 128 experts, top-8, 200 tokens "
            "(B = 4 requests decoded together: 50 steps of 4..4 tokens)") in out
    assert "tok/s: one request's decode tokens per second" in out and "not the batch's total" in out
    doc = json.loads(js.read_text())
    assert doc["requests"] == 4 and "one request's" in doc["tok_s_is"]
    assert main(args) == 0
    assert "tok/s: one request's" not in capsys.readouterr().out  # one stream: nothing to explain


# -- python -m expertcache -----------------------------------------------------------------------
def test_python_m_expertcache_runs_the_cli():
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "expertcache", "--version"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("expertcache ")
    done = subprocess.run([sys.executable, "-m", "expertcache", "sim", "/nonexistent.npz"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2 and "trace file not found" in done.stderr


# -- on the shared trace: --lag as fast as the plain replay ----------------------------------------
def test_lag_on_the_shared_trace_matches_the_lagged_table():
    if not SHARED.exists():
        pytest.skip(f"shared traces not found at {SHARED.parent} (tests read ../shared/traces/)")
    from expertcache.sim.lag import lag_replays
    from expertcache.sim.replay import Prepared
    prep = Prepared(batch_traces([load_trace(SHARED).slice_tokens(400)], 4))
    fast = lag_replays(prep, "default", 768, "global", [1, 2])
    slow = lag_replays(prep, "default", 768, "global", [1, 2], engine="table")
    assert [f.stats.to_dict() for f in fast] == [s.stats.to_dict() for s in slow]
    assert [f.host_copies for f in fast] == [s.host_copies for s in slow]


def test_bench_says_when_slots_exceed_the_experts(capsys):
    pytest.importorskip("torch")
    assert main(["bench", "--preset", "olmoe", "--layers", "2", "--tokens", "8", "--scale", "0.03",
                 "--dtype", "fp32", "--policy", "lru", "--slots", "100000", "--device", "cpu",
                 "--threads", "1", "--baselines", "none", "--no-belady", "--hardware", "none"]) in (0, 1)
    out = " ".join(capsys.readouterr().out.split())
    assert "note: --slots 100000 above the 128 experts (2 x 64): the pool holds 128, every expert resident" in out
    assert "planner: host (each step's routing is read back" in out
