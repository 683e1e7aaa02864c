"""``benchmarks/bench_beyond_ram.py``: its model builder writes a GGUF our loader reads (at a
tiny depth and width of its shape), whose tiered decode equals the all-in-RAM one, and its
scoring counts the decode's disk bytes and the tier's hit rate."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import expertcache

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_beyond_ram.py"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # it imports bench_tiers
    spec = importlib.util.spec_from_file_location("bench_beyond_ram", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_built_model_loads_and_the_tier_decodes_as_in_ram(bench, tmp_path, monkeypatch):
    monkeypatch.setitem(bench.SHAPE, "layers", 2)
    monkeypatch.setitem(bench.SHAPE, "experts", 16)
    path = bench.build_model(tmp_path / "small.gguf", update=0.1)
    assert not (tmp_path / "small.part").exists()  # written under another name, then renamed
    tokens = {}
    for host in ({"host_memory": "copy"}, {"host_memory": "tiered", "host_budget": "25%"}):
        model = expertcache.offload(str(path), device="cpu", baseline="resident", **host)
        torch.manual_seed(0)
        out = model.generate(torch.tensor([[5, 9, 77, 120]]), max_new_tokens=6, do_sample=True, temperature=1.0,
                             top_k=0, top_p=1.0)
        tokens[host["host_memory"]] = out[0].tolist()
    assert tokens["tiered"] == tokens["copy"]
    assert len(set(tokens["copy"][4:])) > 1  # sampled: the routing moves


def test_scoring(bench):
    run = {"decode_disk_read_bytes": 40 << 20, "decode_tokens": 4, "tok_s": 2.0, "tokens": [1, 2],
           "tier": {"decode": {"ram_hits": 90, "accesses": 100}}}
    bench._score(run, bandwidth=20 << 20, mmap_tokens=[1, 2])  # 10 MiB a token at 20 MiB/s: 2 tok/s
    assert run["disk_bytes_per_token"] == 10 << 20 and run["disk_bound_tok_s"] == 2.0
    assert run["of_disk_bound"] == 1.0 and run["ram_hits"] == 0.9 and run["tokens_equal_mmap"]
    mmap = {"decode_disk_read_bytes": 0, "decode_tokens": 4, "tok_s": 2.0, "tokens": [1], "tier": None}
    bench._score(mmap, bandwidth=1.0, mmap_tokens=None)
    assert mmap["disk_bound_tok_s"] is None and mmap["ram_hits"] is None and mmap["tokens_equal_mmap"] is None
