"""One entry point for per-layer expert counts from any source file.

``load_counts(path)`` accepts an imatrix GGUF (or a legacy ``.dat``, which it
explains), a routing trace ``.npz`` (counts of its selections), a popularity
JSON (Fiddler's ``expert_popularity`` or this tool's own ``--json`` output with
``counts``) and a ``.npy`` holding ``[L, E]``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .counts import ExpertCounts
from .reader import GGUF_MAGIC, read

KINDS = ("imatrix", "trace", "json", "npy")


def load_counts(path: str | Path, kind: str | None = None, *, tokens: slice | None = None) -> ExpertCounts:
    """Expert counts ``[L, E]`` from ``path``; ``kind`` is guessed from the content when None.

    ``tokens`` restricts a trace to a token range (e.g. the first half, to
    learn a plan on one part and replay the other).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"counts file not found: {path}")
    kind = kind or guess_kind(path)
    if kind not in KINDS:
        raise ValueError(f"unknown counts source kind {kind!r}; use one of {', '.join(KINDS)}")
    if tokens is not None and kind != "trace":
        raise ValueError(f"{path}: a token range only applies to a routing trace, not to a {kind} file")
    if kind == "imatrix":
        return read(path)
    if kind == "trace":
        from ..trace import load_trace

        return trace_counts(load_trace(path), tokens, source=str(path))
    if kind == "json":
        return _json_counts(path)
    return _npy_counts(path)


def guess_kind(path: Path) -> str:
    suffix = path.suffix.lower()
    with open(path, "rb") as fh:
        head = fh.read(6)
    if head[:4] == GGUF_MAGIC or suffix in (".gguf", ".dat"):
        return "imatrix"
    if suffix == ".npz" or head[:2] == b"PK":
        return "trace"
    if suffix == ".npy" or head == b"\x93NUMPY":
        return "npy"
    if suffix == ".json" or head.lstrip()[:1] in (b"{", b"["):
        return "json"
    raise ValueError(f"{path}: cannot tell what this file is; expected an imatrix .gguf/.dat, a trace "
                     ".npz, a popularity .json or a counts .npy")


def trace_counts(trace, tokens: slice | None = None, *, source: str = "trace") -> ExpertCounts:
    """How often each (layer, expert) was selected in a trace (every rank counts once)."""
    experts = trace.experts if tokens is None else trace.experts[:, tokens]  # [L, T, K]
    if experts.shape[1] == 0:
        raise ValueError(f"{source}: the token range {tokens} selects no tokens")
    E = trace.num_experts
    counts = np.stack([np.bincount(layer.ravel().astype(np.int64), minlength=E)
                       for layer in experts])
    meta = {"tokens": int(experts.shape[1]), "top_k": trace.top_k, "model": trace.meta.get("model")}
    return ExpertCounts(counts, source=source, kind="trace", meta=meta)


def _json_counts(path: Path) -> ExpertCounts:
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON: {err}") from None
    if isinstance(data, dict) and "expert_popularity" in data:
        meta = {"total_input_tokens": data.get("total_input_tokens")}
        return ExpertCounts(data["expert_popularity"], source=str(path), kind="json", meta=meta)
    if isinstance(data, dict) and "counts" in data:
        return ExpertCounts(data["counts"], source=str(path), kind="json",
                            meta={k: data[k] for k in ("source", "metadata") if k in data})
    raise ValueError(f"{path}: JSON without 'expert_popularity' or 'counts'; expected a [layers][experts] "
                     "table of per-expert selection counts under one of those keys")


def _npy_counts(path: Path) -> ExpertCounts:
    try:
        arr = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise ValueError(f"{path}: not a readable .npy array (truncated or corrupt?): {err}") from None
    return ExpertCounts(arr, source=str(path), kind="npy")
