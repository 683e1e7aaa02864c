"""The CUDA staging copy (a Triton kernel over a fixed grid that skips rows past the miss
count), run by Triton's interpreter on the CPU in a child process (the interpreter is
chosen when triton is imported): rows below the count are the ordered experts' rows, rows
past it are untouched, and the device layer step with it equals the experts from the host."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton", reason="triton is installed with vLLM (.venv-vllm)")

SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    sys.path.insert(0, {tests!r})
    from test_vllm_device_step import E, H, I, K, S, experts_out
    from expertcache.vllm.stage import stage_rows
    from expertcache.vllm.device import layer_step

    torch.manual_seed(0)
    src = torch.randn(E, 2 * I, H)
    dst = torch.full((5, 2 * I, H), float("nan"))
    order = torch.tensor([7, 2, 9, 0, 1])
    stage_rows(dst, src, order, torch.tensor(3, dtype=torch.int32))
    assert torch.equal(dst[:3], src[order[:3]]) and dst[3:].isnan().all()

    torch.compiler.is_compiling = lambda: True   # the fixed-grid branch, as on CUDA
    hosts = (torch.randn(E, 2 * I, H), torch.randn(E, H, I))
    pool = (torch.full((S + E, 2 * I, H), float("nan")), torch.full((S + E, H, I), float("nan")))
    slot_row = torch.full((E,), -1, dtype=torch.int32)
    for slot, e in enumerate((4, 9)):
        slot_row[e] = slot
        for host, rows in zip(hosts, pool):
            rows[slot] = host[e]
    ids = torch.tensor([[4, 1, 9], [2, 1, 0]], dtype=torch.int32)   # misses 0, 1, 2; a grid of 6
    x, w = torch.randn(2, H), torch.rand(2, K)
    record = torch.zeros(8, K, dtype=torch.int32)
    out = layer_step(x, w, ids, slot_row, hosts, pool, record, S,
                     lambda x, w, rows: experts_out(x, w, rows, *pool), stage=stage_rows)
    assert torch.equal(out, experts_out(x, w, ids, *hosts))
    assert not pool[0][S:S + 3].isnan().any() and pool[0][S + 3:S + 6].isnan().all()  # grid rows skipped
    print("OK")
""")


def test_stage_rows_skips_the_grid_rows_past_the_miss_count(tmp_path):
    script = tmp_path / "stage.py"
    script.write_text(SCRIPT.format(tests=os.path.join(os.path.dirname(__file__), "..")))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip().endswith("OK"), done.stderr[-3000:]
