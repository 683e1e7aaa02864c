"""The routing-trace file format (.npz) and its validation.

Arrays: ``experts`` int16 ``[L, T, k]`` (required; experts each token selected
at each MoE layer, router rank order), ``weights`` float16 ``[L, T, k]``
(optional), ``logits`` float16 ``[L, T, E]`` (optional; the router's raw scores for
every expert, before softmax or sigmoid, as ``trace record --router-logits`` saves
them), ``phase`` uint8 ``[T]`` (optional; 0 prompt, 1 generation; absent
means all generation), ``meta`` a JSON string with ``model``, ``num_experts``,
``top_k``, ``n_moe_layers`` and optionally ``expert_bytes`` and ``source``.
"""

from __future__ import annotations

import json
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REQUIRED_META = ("num_experts", "top_k", "n_moe_layers")


class TraceError(ValueError):
    """A trace file or array that does not follow the format; the message says what to fix."""


@dataclass
class Trace:
    experts: np.ndarray                 # int16 [L, T, k], rank order
    meta: dict = field(default_factory=dict)
    weights: np.ndarray | None = None   # float16 [L, T, k]
    phase: np.ndarray | None = None     # uint8 [T]: 0 prompt, 1 generation
    logits: np.ndarray | None = None    # float16 [L, T, E]: router scores of every expert

    def __post_init__(self) -> None:
        validate(self)

    @property
    def num_layers(self) -> int:
        return self.experts.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.experts.shape[1]

    @property
    def top_k(self) -> int:
        return self.experts.shape[2]

    @property
    def num_experts(self) -> int:
        return int(self.meta["num_experts"])

    @property
    def expert_bytes(self) -> int | None:
        value = self.meta.get("expert_bytes")
        return int(value) if value is not None else None

    @property
    def phases(self) -> np.ndarray:
        """``phase`` with the default filled in: all generation when absent."""
        if self.phase is None:
            return np.ones(self.num_tokens, dtype=np.uint8)
        return self.phase

    def summary(self) -> dict:
        """Meta plus the shape, as the simulator's JSON reports it."""
        return {**self.meta, "layers": self.num_layers, "tokens": self.num_tokens,
                "top_k": self.top_k}

    def slice_tokens(self, stop: int) -> Trace:
        """The first ``stop`` tokens (for quick runs on long traces)."""
        cut = lambda a: None if a is None else a[:, :stop].copy()  # noqa: E731  [L, T, ...]: cut T
        meta = dict(self.meta)
        if isinstance(meta.get("step_tokens"), list):  # a grouped trace: its steps cut too
            sizes, left = [], stop
            for n in meta["step_tokens"]:
                if left <= 0:
                    break
                sizes.append(min(n, left))
                left -= n
            meta["step_tokens"] = sizes
        return Trace(self.experts[:, :stop].copy(), meta, cut(self.weights),
                     None if self.phase is None else self.phase[:stop].copy(), cut(self.logits))


def validate(trace: Trace, where: str = "trace") -> None:
    ex = trace.experts
    if not isinstance(ex, np.ndarray) or ex.ndim != 3:
        raise TraceError(f"{where}: 'experts' must be a 3-D array [layers, tokens, top_k], "
                         f"got shape {getattr(ex, 'shape', None)}")
    if not np.issubdtype(ex.dtype, np.integer):
        raise TraceError(f"{where}: 'experts' must hold integers, got dtype {ex.dtype}")
    if ex.dtype != np.int16:
        if ex.size and (ex.min() < -32768 or ex.max() > 32767):
            raise TraceError(f"{where}: expert ids do not fit int16")
        trace.experts = ex = ex.astype(np.int16)
    meta = trace.meta
    missing = [k for k in REQUIRED_META if k not in meta]
    if missing:
        raise TraceError(f"{where}: meta lacks {', '.join(missing)}; it needs "
                         f"{', '.join(REQUIRED_META)} (and should name the 'model')")
    for key in REQUIRED_META:
        if not isinstance(meta[key], int) or isinstance(meta[key], bool) or meta[key] < 1:
            raise TraceError(f"{where}: meta[{key!r}] must be a positive integer, got {meta[key]!r}")
    L, T, k = ex.shape
    if meta["n_moe_layers"] != L:
        raise TraceError(f"{where}: meta says n_moe_layers={meta['n_moe_layers']} but 'experts' has {L} layers")
    if meta["top_k"] != k:
        raise TraceError(f"{where}: meta says top_k={meta['top_k']} but 'experts' has {k} per token")
    E = meta["num_experts"]
    if k > E:
        raise TraceError(f"{where}: top_k={k} exceeds num_experts={E}")
    if ex.size and (ex.min() < 0 or ex.max() >= E):
        bad = np.argwhere((ex < 0) | (ex >= E))[0]
        raise TraceError(f"{where}: expert id {ex[tuple(bad)]} at layer {bad[0]}, token {bad[1]} "
                         f"is outside 0..{E - 1}")
    eb = meta.get("expert_bytes")
    if eb is not None and (not isinstance(eb, int) or isinstance(eb, bool) or eb < 1):
        raise TraceError(f"{where}: meta['expert_bytes'] must be a positive integer or absent, got {eb!r}")
    if trace.weights is not None:
        trace.weights = _float16(trace.weights, "weights", ex.shape, "like 'experts'", "rank", where)
    if trace.logits is not None:
        trace.logits = _float16(trace.logits, "logits", (L, T, E), "[layers, tokens, num_experts]",
                                "expert", where)
    if trace.phase is not None:
        ph = np.asarray(trace.phase)
        if ph.shape != (T,):
            raise TraceError(f"{where}: 'phase' has shape {ph.shape}, expected ({T},): one per token")
        if ph.size and not np.isin(ph, (0, 1)).all():
            t = int(np.flatnonzero(~np.isin(ph, (0, 1)))[0])
            raise TraceError(f"{where}: 'phase' must be 0 (prompt) or 1 (generation); token {t} "
                             f"has {ph[t].item()!r}")
        trace.phase = ph.astype(np.uint8, copy=False)


def _float16(a: np.ndarray, name: str, shape: tuple, what: str, last: str, where: str) -> np.ndarray:
    """``a`` as float16 after checking its shape and that every value is finite."""
    if a.shape != shape:
        raise TraceError(f"{where}: {name!r} has shape {a.shape}, expected {shape} {what}")
    if not np.issubdtype(a.dtype, np.number):
        raise TraceError(f"{where}: {name!r} must hold numbers, got dtype {a.dtype}")
    a = a.astype(np.float16, copy=False)
    if not np.isfinite(a).all():
        bad = np.argwhere(~np.isfinite(a))[0]
        raise TraceError(f"{where}: {name!r} has a non-finite value at layer {bad[0]}, token "
                         f"{bad[1]}, {last} {bad[2]} (or exceeds float16's range)")
    return a


def load_trace(path: str | Path) -> Trace:
    """Read and validate a trace; every problem is a TraceError naming the file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"trace file not found: {path}")
    if path.is_dir():
        raise TraceError(f"{path} is a directory; give a trace file (.npz) in it, e.g. "
                         f"{path / 'trace.npz'}")
    _check_archive(path)
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: _read_member(data, name, path) for name in data.files}
    except (zipfile.BadZipFile, EOFError, OSError, zlib.error) as err:
        raise TraceError(f"{path}: corrupt .npz trace, an array cannot be read (truncated or "
                         f"damaged?): {err}") from None
    if "experts" not in arrays:
        raise TraceError(f"{path}: no 'experts' array (found: {', '.join(arrays) or 'nothing'}); "
                         "a trace needs experts int16 [layers, tokens, top_k]")
    meta = _parse_meta(arrays.get("meta"), path)
    ex = arrays["experts"]
    if ex.ndim == 3:  # fill what the shared traces leave implicit
        meta.setdefault("n_moe_layers", ex.shape[0])
        meta.setdefault("top_k", ex.shape[2])
    return _build(arrays, meta, str(path))


def _check_archive(path: Path) -> None:
    """Name the common ways a file is not a .npz before numpy gives a vaguer error."""
    with open(path, "rb") as fh:
        head = fh.read(6)
    if not head:
        raise TraceError(f"{path}: file is empty (0 bytes); a trace is a .npz archive")
    if head.startswith(b"\x93NUMPY"):
        raise TraceError(f"{path}: a single .npy array, not a .npz archive; save 'experts' and "
                         "'meta' together with save_trace (or np.savez)")
    if not zipfile.is_zipfile(path):
        if head.startswith(b"PK"):
            raise TraceError(f"{path}: truncated .npz: it starts like a zip archive but the "
                             "directory at its end is missing (an interrupted copy or write?)")
        raise TraceError(f"{path}: not a .npz archive (no zip signature); write traces with "
                         "save_trace or np.savez")


def _read_member(data, name: str, path: Path) -> np.ndarray:
    try:
        return data[name]
    except ValueError as err:
        if "pickle" in str(err) or "Object arrays" in str(err):
            raise TraceError(f"{path}: array {name!r} holds Python objects; trace arrays must be "
                             "plain numeric arrays and 'meta' a JSON string") from None
        raise TraceError(f"{path}: array {name!r} cannot be read: {err}") from None


def _build(arrays: dict, meta: dict, where: str) -> Trace:
    trace = Trace.__new__(Trace)
    trace.experts, trace.meta = arrays["experts"], meta
    trace.weights, trace.phase = arrays.get("weights"), arrays.get("phase")
    trace.logits = arrays.get("logits")
    validate(trace, where)
    return trace


def _parse_meta(raw, path: Path) -> dict:
    if raw is None:
        raise TraceError(f"{path}: no 'meta' JSON string; it must give num_experts, top_k, n_moe_layers")
    try:
        meta = json.loads(str(raw))
    except json.JSONDecodeError as err:
        raise TraceError(f"{path}: 'meta' is not valid JSON: {err}") from None
    if not isinstance(meta, dict):
        raise TraceError(f"{path}: 'meta' must be a JSON object")
    return meta


def save_trace(trace: Trace, path: str | Path) -> Path:
    """Write a validated trace; the file is written whole or not at all."""
    validate(trace)
    path = Path(path)
    arrays = {"experts": trace.experts, "meta": np.array(json.dumps(trace.meta))}
    if trace.weights is not None:
        arrays["weights"] = trace.weights
    if trace.phase is not None:
        arrays["phase"] = trace.phase
    if trace.logits is not None:
        arrays["logits"] = trace.logits
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        np.savez_compressed(fh, **arrays)
    tmp.replace(path)
    return path
