"""The cache's statistics as JSON (``stats_path``) and as Prometheus gauges.

The JSON is ``LiveStats.to_dict()`` (what ``model.expertcache.stats()`` gives: per phase
and per layer, hits, misses, loads, evictions, bypasses, H2D bytes) with the headline
numbers at the top level: ``slots``, ``hits``, ``misses``, ``h2d_bytes``, plus tokens and
per-token rates per phase. Written every ``stats_every`` counted steps and at exit.

Prometheus: the engine runs in another process than vLLM's HTTP server, so each writer
also drops its snapshot in a folder named by ``EXPERTCACHE_VLLM_METRICS_DIR`` (set by the
plug-in in the first vLLM process, inherited by the processes it starts); a collector
registered in the server's process reads the snapshots at each scrape of ``/metrics``.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from ..stats import DECODE, PREFILL

METRICS_DIR_ENV = "EXPERTCACHE_VLLM_METRICS_DIR"
PHASES = {"prefill": PREFILL, "decode": DECODE}


def document(session) -> dict:
    stats = session.stats()
    out = {"slots": session.pool.slots if session.pool else None, "hits": 0, "misses": 0,
           "h2d_bytes": 0, "accesses": 0, "hit_rate": 0.0,
           "tokens": dict(zip(PHASES, session.tokens)), **session.summary()}
    if stats is None:
        return out
    total = stats.total()
    out.update(hits=total.hits, misses=total.misses, accesses=total.accesses,
               hit_rate=total.hit_rate, h2d_bytes=stats.h2d_bytes())
    out["per_token"] = {
        name: {"hits": stats.total(p).hits / n, "misses": stats.total(p).misses / n,
               "h2d_bytes": stats.h2d_bytes(p) / n} if (n := session.tokens[p]) else None
        for name, p in PHASES.items()}
    out["stats"] = stats.to_dict()
    return out


class Telemetry:
    def __init__(self, session) -> None:
        self.session = session
        self.path = session.settings.stats_path
        folder = os.environ.get(METRICS_DIR_ENV)
        self.live = Path(folder) / f"{os.getpid()}.json" if folder else None

    def write(self) -> None:
        doc = None
        for path in (self.path, self.live):
            if path is None:
                continue
            doc = doc or document(self.session)
            _atomic_write(Path(path), json.dumps(doc, indent=1))


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


# -- Prometheus ---------------------------------------------------------------------
GAUGES = (("hits", "Expert accesses served from a slot"),
          ("misses", "Expert accesses that needed a copy"),
          ("accesses", "Expert accesses (layer steps x experts)"),
          ("h2d_bytes", "Expert bytes copied host -> device"),
          ("slots", "Cache slots in the pool"),
          ("hit_rate", "hits / accesses"))


class Collector:
    """prometheus_client collector: sums the live snapshots of this server's engine processes."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        docs = []
        for path in sorted(self.folder.glob("*.json")):
            try:
                docs.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue  # a snapshot being replaced: the next scrape reads it
        for name, doc in GAUGES:
            gauge = GaugeMetricFamily(f"expertcache_{name}", doc)
            if docs:
                if name == "hit_rate":
                    acc = sum(d.get("accesses", 0) for d in docs)
                    value = sum(d.get("hits", 0) for d in docs) / acc if acc else 0.0
                else:
                    value = sum(d.get(name) or 0 for d in docs)
                gauge.add_metric([], value)
            yield gauge


def register_collector() -> None:
    """In the process that serves ``/metrics``: one collector over a fresh snapshot folder."""
    if os.environ.get(METRICS_DIR_ENV):
        return  # a child of the process that set it up
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return
    # named now, made by the first snapshot: nothing is left behind when the cache is off
    folder = os.path.join(tempfile.gettempdir(), f"expertcache-vllm-{os.getpid()}")
    os.environ[METRICS_DIR_ENV] = folder
    REGISTRY.register(Collector(folder))
