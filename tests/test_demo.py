"""``expertcache demo`` shortened: both tables, both plots, the JSON files and a verdict."""

from __future__ import annotations

import json

from expertcache.cli import main


def test_demo_writes_plots_and_ends_with_a_verdict(tmp_path, capsys):
    out = tmp_path / "demo"
    code = main(["demo", "--out", str(out), "--tokens", "100", "--layers", "2", "--scale", "0.03",
                 "--dtype", "fp32", "--device", "cpu"])
    text = capsys.readouterr().out
    assert code == 0
    for name in ("sim_hit_rate.png", "bench_tok_s.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG" and (out / name).stat().st_size > 10_000
    sim = json.loads((out / "sim.json").read_text())
    assert sim["trace"]["layers"] == 48 and {r["policy"] for r in sim["results"]} >= {"lru", "belady"}
    bench = json.loads((out / "bench.json").read_text())
    assert bench["layers"] == 2 and bench["tokens"] == 100 - 64  # the default trace's prompt is 64
    strategies = {r["strategy"] for r in bench["results"]}
    assert strategies == {"resident", "copy-every-pass", "cpu", "cache", "belady"}
    # the simulator table, the bench table and the verdict all reach the terminal
    assert "opt misses" in text and "copy-every-pass" in text
    verdict = text[text.index("Fastest in steady state"):]
    fastest = max((r for r in bench["results"] if r["tok_s"] and r["strategy"] != "belady"),
                  key=lambda r: r["tok_s"])
    assert f"{fastest['tok_s']:.1f} tok/s" in verdict.splitlines()[0]
    assert "the speed of copy-every-pass" in verdict or fastest["strategy"] == "copy-every-pass"
    assert "Simulator, 1536 slots: best policy" in text
    assert "checks: H2D bytes add up" in text and bench["checks"]["ok"]
