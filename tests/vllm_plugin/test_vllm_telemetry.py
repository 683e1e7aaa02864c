"""The Prometheus collector sums the engine processes' snapshots (what /metrics shows)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("prometheus_client", reason="prometheus_client comes with vLLM (.venv-vllm)")


def test_collector_sums_snapshots(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest

    from expertcache.vllm.telemetry import Collector

    registry = CollectorRegistry()
    registry.register(Collector(str(tmp_path / "live")))
    empty = generate_latest(registry).decode()
    assert "# TYPE expertcache_hits gauge" in empty
    assert not [ln for ln in empty.splitlines() if ln.startswith("expertcache_")]  # no engine yet: no sample
    (tmp_path / "live").mkdir()
    for pid, (hits, misses) in {11: (30, 10), 12: (5, 15)}.items():
        (tmp_path / "live" / f"{pid}.json").write_text(json.dumps(
            {"hits": hits, "misses": misses, "accesses": hits + misses, "h2d_bytes": misses * 100,
             "slots": 8}))
    (tmp_path / "live" / "13.json").write_text("{half written")  # skipped, read next scrape
    text = generate_latest(registry).decode()
    values = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln.startswith("expertcache_")}
    assert values == {"expertcache_hits": 35, "expertcache_misses": 25, "expertcache_accesses": 60,
                      "expertcache_h2d_bytes": 2500, "expertcache_slots": 16,
                      "expertcache_hit_rate": 35 / 60}
