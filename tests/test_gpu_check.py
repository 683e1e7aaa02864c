"""benchmarks/gpu_check.sh fits the GPU lease: its rehearsal runs every step here, at toy sizes,
with the output layout the device tool brings back (issue 24)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
LEASE_S = 480   # the check's own share of a 15-minute lease (10 minutes a command at most)
MAX_FILES = 8   # what the device tool brings back from $OUT


def step_limits() -> dict[str, int]:
    text = SCRIPT.read_text()
    limits = {name: int(s) for name, s in re.findall(r"^step (\w+) (\d+) ", text, re.M)}
    limits.update(summary=int(re.search(r"^timeout (\d+) .*gpu_check.py summary", text, re.M).group(1)))
    return limits


def test_the_step_timeouts_sum_well_under_the_lease():
    limits = step_limits()
    assert list(limits)[:2] == ["tests", "real"]        # the most valuable figures first
    assert sum(limits.values()) <= LEASE_S - 60, limits


@pytest.mark.slow
def test_the_rehearsal_runs_every_step_and_brings_back_few_files(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    run = subprocess.run(["bash", str(SCRIPT), "--rehearse"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    files = [p for p in out.rglob("*") if p.is_file()]
    assert 0 < len(files) <= MAX_FILES
    assert all(len(p.relative_to(out).parts) <= 3 for p in files)    # no more than 2 folders down
    log = (out / "gpu_check.log").read_text()
    assert "== gpu_check summary" in log and run.stdout.strip().endswith(f"results: {out}")
    doc = json.loads((out / "gpu_check.json").read_text())
    steps = {s["name"]: s for s in doc["steps"]}
    assert set(steps) == {"tests", "real", "quant", "dequant"}
    assert all(s["rc"] == 0 for s in steps.values()), steps
    names = [r["name"] for r in doc["real"]["rows"]]
    assert names[:3] == ["plain transformers (all on the device)", "resident", "25% fetch"]
    assert {"cpu (--cpu-moe)", "copy-every-pass", "50% auto"} <= set(names)
    for row in doc["real"]["rows"]:   # exact against plain transformers, every configuration
        assert row["tokens_equal"] and row["max_logit_diff"] <= 1e-4, row
    fetch = next(r for r in doc["real"]["rows"] if r["name"] == "25% fetch")
    assert 0 < fetch["hit_rate"] < 1 and fetch["h2d_mb_per_token"] > 0
    assert doc["dequant"]["dequant_ms"] > 0 and doc["bench_quantized"]["results"]
    assert doc["bench_quantized"]["checks"]["ok"]
