"""What a model file declares, read without loading it: its context and its expert counts.

Lets the CLI refuse a request the loaded model would refuse (a context too short for
``--max-new-tokens``, ``--slots`` below top-k) before the minutes of loading.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..cache import partition_shares
from ..config import CacheConfig
from ..ggufmodel.header import is_gguf, read_header


def model_context(path: Path) -> int | None:
    """The context in tokens a model file declares (the GGUF header's ``<arch>.context_length``
    or config.json's ``max_position_embeddings``); None if it says none."""
    return declared(path, "context_length", ("max_position_embeddings",))


def check_cache_size(path: Path, config: CacheConfig) -> None:
    """Refuse ``slots`` below the model's top-k before loading it (read from the GGUF header or
    config.json): the same check and message the table makes once the model is loaded."""
    top_k = declared(path, "expert_used_count", ("num_experts_per_tok",))
    experts = declared(path, "expert_count", ("num_experts", "num_local_experts", "n_routed_experts"))
    if config.slots is None or not config.needs_size or top_k is None or experts is None:
        return
    if config.partition == "global":  # per-layer needs the MoE layer count: the table checks it
        partition_shares(1, experts, config.slots, "global", min(top_k, experts))


def declared(path: Path, gguf_key: str, hf_keys: tuple[str, ...]) -> int | None:
    """A positive whole number the model declares: ``<arch>.gguf_key`` in a GGUF header, the
    first of ``hf_keys`` in config.json (or its text_config); None when absent or unreadable."""
    if is_gguf(path):
        header = read_header(path)
        value = header.metadata.get(f"{header.arch}.{gguf_key}")
    else:
        try:
            cfg = json.loads((path / "config.json").read_text())
        except (OSError, json.JSONDecodeError):
            return None
        scopes = (cfg, cfg.get("text_config") or {})
        value = next((s[k] for k in hf_keys for s in scopes if s.get(k) is not None), None)
    try:
        value = int(value)
    except (TypeError, ValueError):
        return None
    return value if value > 0 else None
