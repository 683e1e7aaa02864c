"""The ``expertcache`` block of vLLM's ``additional_config``, validated once (torch-free).

Keys are ``offload()``'s names: ``slots`` or ``gpu_memory``, ``eviction`` (CLI syntax,
``"slru:protected=0.5"``, or a whole spec ``"lru+second-hit"``), ``admission``,
``partition``, ``staging``, ``imatrix``, ``imatrix_mode``, ``planner`` (``"host"``, which
``"auto"``, the default, means here: plan each layer step on the host; ``"device"``: the step runs on the device and the policy
``lag`` engine steps behind, docs/vllm.md) and ``lag``; plus the plug-in's own
``stats_path``, ``stats_every`` and ``record_trace``. Everything goes through
``CacheConfig`` (the same checks as ``offload()`` and the CLI) before vLLM loads a
weight; a bad value is one line that names the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..config import CacheConfig
from ..policies.registry import parse_policy

KEY = "expertcache"
CACHE_KEYS = ("slots", "gpu_memory", "eviction", "admission", "partition", "staging", "imatrix",
              "imatrix_mode", "planner", "lag")
OWN_KEYS = ("stats_path", "stats_every", "record_trace")
DEFAULT_STATS_EVERY = 256  # engine steps between two stats.json writes


@dataclass(frozen=True)
class Settings:
    cache: CacheConfig
    stats_path: str | None = None
    stats_every: int = DEFAULT_STATS_EVERY
    record_trace: str | None = None

    @property
    def planner(self) -> str:
        """'host' or 'device'. 'auto' (the default) is the host planner here: vLLM captures its own
        graphs, and the host planner's piecewise mode is the one measured; 'device' is asked for."""
        return "host" if self.cache.planner == "auto" else self.cache.planner


def from_additional_config(additional: object) -> Settings | None:
    """``None`` when the plug-in is not asked for (no ``expertcache`` key); else validated settings."""
    if not isinstance(additional, dict) or additional.get(KEY) is None:
        return None
    block = additional[KEY]
    if not isinstance(block, dict):
        raise ValueError(f"additional_config['{KEY}'] must be a JSON object such as "
                         f'{{"slots": 64, "eviction": "lru"}}, got {type(block).__name__}')
    return parse(block)


def parse(block: dict) -> Settings:
    unknown = sorted(set(block) - set(CACHE_KEYS) - set(OWN_KEYS))
    if unknown:
        raise ValueError(f"expertcache: unknown key(s) {', '.join(map(repr, unknown))}; "
                         f"use {', '.join(CACHE_KEYS + OWN_KEYS)}")
    if block.get("planner") == "device" and block.get("record_trace") is not None:
        raise ValueError("expertcache: record_trace needs planner 'host' (the device planner records "
                         "routing for its policy, not as a trace yet)")
    return Settings(_cache_config(block), _out_path(block, "stats_path"), _stats_every(block),
                    _out_path(block, "record_trace"))


def _cache_config(block: dict) -> CacheConfig:
    eviction, admission = block.get("eviction", "default"), block.get("admission")
    for key, value in (("eviction", eviction), ("admission", admission)):
        if value is not None and not isinstance(value, str):
            raise ValueError(f"expertcache: {key} must be a string such as 'lru' or "
                             f"'slru:protected=0.5', got {value!r}")
    if admission is not None and "+" in eviction:
        raise ValueError(f"expertcache: eviction {eviction!r} already names an admission policy; "
                         "drop the 'admission' key or the '+ADMISSION' part")
    spec = eviction if admission is None else f"{eviction}+{admission}"
    kwargs = {k: block[k] for k in ("slots", "gpu_memory", "partition", "staging", "imatrix",
                                    "imatrix_mode", "planner", "lag") if k in block}
    try:
        policy = parse_policy(spec)
        return CacheConfig(eviction=policy.eviction, admission=policy.admission, **kwargs)
    except (ValueError, TypeError) as err:
        raise ValueError(f"expertcache: {_first_line(err)}") from None


def _out_path(block: dict, key: str) -> str | None:
    value = block.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expertcache: {key} must be a file path, got {value!r}")
    folder = Path(value).expanduser().parent
    if not folder.is_dir():
        raise ValueError(f"expertcache: {key}: folder {str(folder)!r} does not exist; create it first")
    return str(Path(value).expanduser())


def _stats_every(block: dict) -> int:
    value = block.get("stats_every", DEFAULT_STATS_EVERY)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"expertcache: stats_every must be a positive whole number of engine "
                         f"steps, got {value!r}")
    return value


def _first_line(err: Exception) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__
