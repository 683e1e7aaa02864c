"""The device step's Triton row gather (runtime/devicestep.py), run by Triton's interpreter on
the CPU: the vLLM venv is where Triton is installed. On CUDA the same kernel reads the pinned
host store through its device view; the interpreter checks its indexing and its masks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = """
import torch
from expertcache.runtime.devicestep import _triton_gather
E, D = 5, 5000                       # rows wider than one block: two programs per row
src = torch.arange(E * D, dtype=torch.float32).view(E, D)
rows = torch.tensor([3, E, 0, E, 4]) # E: a sentinel row, which must load and store nothing
out = torch.full((5, D), -1.0)
_triton_gather(src, rows, out)
assert torch.equal(out[0], src[3]) and torch.equal(out[2], src[0]) and torch.equal(out[4], src[4])
assert (out[1] == -1).all() and (out[3] == -1).all()
print("gathered")
"""


def test_the_gather_copies_named_rows_and_skips_sentinels():
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0 and "gathered" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]
