"""Importers: routing logs of other tools into the ``.npz`` trace format.

* ``route-csv``: llama.cpp-style ``route_trace v1`` CSV (``#`` header lines with
  ``n_layer``, ``n_expert``, ``n_expert_used`` and per-layer ``expert_bytes``;
  rows ``turn,phase,step,layer,slot,expert,weight,residency,expert_bytes``).
  A token is ``(turn, step)``; ``slot`` is the router rank. ``residency`` and the
  per-row ``expert_bytes`` describe the recording device's cache, not the
  routing, and are not kept.
* ``jsonl``: one record per (token, layer): ``{"layer", "experts", "token_idx"}``
  plus optional ``"weights"`` and ``"phase"``; an optional ``{"meta": {...}}``
  line supplies ``num_experts``, ``model`` and the like.

Tokens whose records do not cover every layer x top_k are incomplete (llama.cpp
skips the last layer for prompt tokens whose output is not needed): they are
dropped and counted in ``ImportResult.dropped`` and ``meta['dropped_tokens']``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .format import Trace, TraceError

FORMATS = ("route-csv", "jsonl")
CSV_REQUIRED = ("turn", "phase", "step", "layer", "slot", "expert")


@dataclass
class ImportResult:
    trace: Trace
    dropped: int   # incomplete tokens left out
    records: int   # data rows / records read


def import_trace(path: str | Path, fmt: str, **options) -> ImportResult:
    """Import ``path`` written in ``fmt`` (one of ``FORMATS``)."""
    readers = {"route-csv": import_route_csv, "jsonl": import_jsonl}
    if fmt not in readers:
        raise ValueError(f"unknown trace format {fmt!r}; use one of {', '.join(FORMATS)}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"input file not found: {path}")
    return readers[fmt](path, **options)


# -- route_trace v1 CSV ---------------------------------------------------------

def import_route_csv(path: str | Path) -> ImportResult:
    path = Path(path)
    header: dict[str, str] = {}
    layer_bytes: dict[int, int] = {}
    columns: list[str] | None = None
    rows: list[tuple[int, list[str]]] = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            if line.startswith("#"):
                _csv_header_line(line[1:], lineno, path, header, layer_bytes)
            elif columns is None:
                columns = [c.strip() for c in line.split(",")]
                missing = [c for c in CSV_REQUIRED if c not in columns]
                if missing:
                    raise TraceError(f"{path}:{lineno}: column header lacks {', '.join(missing)}; "
                                     f"route_trace v1 needs {','.join(CSV_REQUIRED)}[,weight]")
            else:
                rows.append((lineno, line.split(",")))
    if columns is None:
        raise TraceError(f"{path}: no column header line (turn,phase,step,layer,slot,expert,...) "
                         "after the '#' header")
    L, E, K = (_header_int(header, key, path) for key in ("n_layer", "n_expert", "n_expert_used"))
    records = [_csv_row(fields, lineno, columns, path, L, E, K) for lineno, fields in rows]
    meta = {"model": Path(header.get("model", path.stem)).name.removesuffix(".gguf"),
            "num_experts": E, "top_k": K, "n_moe_layers": L,
            "source": f"route_trace v1 CSV {path.name}"}
    if "arch" in header:
        meta["arch"] = header["arch"]
    if layer_bytes:
        # one slot must hold any expert, so the pool is sized by the largest; the list keeps detail
        meta["expert_bytes"] = max(layer_bytes.values())
        meta["expert_bytes_per_layer"] = [layer_bytes.get(layer) for layer in range(L)]
    has_weight = "weight" in columns
    result = _assemble(records, L, K, meta, has_weight, path)
    return ImportResult(result[0], result[1], len(rows))


def _csv_header_line(text: str, lineno: int, path: Path, header: dict, layer_bytes: dict) -> None:
    text = text.strip()
    if text.startswith("route_trace"):
        if text.split()[-1] != "v1":
            raise TraceError(f"{path}:{lineno}: unsupported {text!r}; this importer reads route_trace v1")
        return
    pairs = dict(re.findall(r"(\w+)=(\S+)", text))
    if "layer" in pairs and "expert_bytes" in pairs:
        try:
            layer_bytes[int(pairs["layer"])] = int(pairs["expert_bytes"])
        except ValueError:
            raise TraceError(f"{path}:{lineno}: layer and expert_bytes must be integers: {text!r}") from None
    else:
        header.update(pairs)


def _header_int(header: dict, key: str, path: Path) -> int:
    if key not in header:
        raise TraceError(f"{path}: the '#' header lacks {key}=N (route_trace v1 writes n_layer, "
                         "n_expert and n_expert_used on its model line)")
    try:
        value = int(header[key])
    except ValueError:
        value = 0
    if value < 1:
        raise TraceError(f"{path}: header {key}={header[key]!r} must be a positive integer")
    return value


def _csv_row(fields: list[str], lineno: int, columns: list[str], path: Path,
             L: int, E: int, K: int) -> tuple:
    where = f"{path}:{lineno}"
    if len(fields) != len(columns):
        raise TraceError(f"{where}: {len(fields)} fields, the header names {len(columns)}")
    row = dict(zip(columns, fields))
    try:
        turn, phase, step, layer, slot, expert = (int(row[c]) for c in CSV_REQUIRED)
    except ValueError:
        raise TraceError(f"{where}: {','.join(CSV_REQUIRED)} must be integers, got "
                         f"{','.join(row[c] for c in CSV_REQUIRED)}") from None
    weight = None
    if "weight" in row:
        try:
            weight = float(row["weight"])
        except ValueError:
            raise TraceError(f"{where}: weight {row['weight']!r} is not a number") from None
    _check_ids(where, layer=layer, expert=expert, slot=slot, L=L, E=E, K=K)
    if phase not in (0, 1):
        raise TraceError(f"{where}: phase {phase} must be 0 (prompt) or 1 (generation)")
    return (turn, step), phase, layer, slot, expert, weight, lineno


def _check_ids(where: str, *, layer: int, expert: int, slot: int, L: int, E: int, K: int) -> None:
    if not 0 <= layer < L:
        raise TraceError(f"{where}: layer {layer} outside 0..{L - 1} (header n_layer={L})")
    if not 0 <= expert < E:
        raise TraceError(f"{where}: expert {expert} outside 0..{E - 1} (num_experts={E})")
    if not 0 <= slot < K:
        raise TraceError(f"{where}: rank {slot} outside 0..{K - 1} (top_k={K})")


# -- JSONL ------------------------------------------------------------------------

def import_jsonl(path: str | Path, num_experts: int | None = None,
                 model: str | None = None) -> ImportResult:
    """``num_experts`` overrides a meta line; without either it is max id + 1 (flagged in meta)."""
    path = Path(path)
    meta: dict = {}
    raw: list[tuple[int, dict]] = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise TraceError(f"{path}:{lineno}: not valid JSON: {err.msg} (column {err.colno})") from None
            if not isinstance(rec, dict):
                raise TraceError(f"{path}:{lineno}: a record must be a JSON object, got {type(rec).__name__}")
            if "meta" in rec:
                if not isinstance(rec["meta"], dict):
                    raise TraceError(f"{path}:{lineno}: 'meta' must be an object")
                meta.update(rec["meta"])
                continue
            raw.append((lineno, rec))
    if not raw:
        raise TraceError(f"{path}: no routing records; each line needs "
                         '{"layer": L, "experts": [...], "token_idx": T}')
    parsed = [_jsonl_record(rec, f"{path}:{lineno}") + (lineno,) for lineno, rec in raw]
    K = len(parsed[0][3])
    for token, phase, layer, experts, weights, lineno in parsed:
        if len(experts) != K:
            raise TraceError(f"{path}:{lineno}: {len(experts)} experts, but line {parsed[0][-1]} "
                             f"has {K}: every record needs the same top_k")
    E = num_experts or meta.get("num_experts")
    max_id = max(max(p[3]) for p in parsed)
    inferred = E is None
    if inferred:
        E = max_id + 1
    if not isinstance(E, int) or isinstance(E, bool) or E < 1:
        raise TraceError(f"{path}: num_experts must be a positive integer, got {E!r}")
    L = int(meta.get("n_moe_layers") or max(p[2] for p in parsed) + 1)
    records = []
    for token, phase, layer, experts, weights, lineno in parsed:
        for rank, expert in enumerate(experts):
            _check_ids(f"{path}:{lineno}", layer=layer, expert=expert, slot=rank, L=L, E=E, K=K)
            records.append((token, phase, layer, rank, expert,
                            None if weights is None else weights[rank], lineno))
    has_weight = parsed[0][4] is not None
    if any((p[4] is not None) != has_weight for p in parsed):
        first = next(p for p in parsed if (p[4] is not None) != has_weight)
        raise TraceError(f"{path}:{first[-1]}: 'weights' must be on every record or on none")
    meta = {**meta, "num_experts": E, "top_k": K, "n_moe_layers": L,
            "model": model or meta.get("model", path.stem),
            "source": meta.get("source", f"JSONL {path.name}")}
    if inferred:
        meta["num_experts_inferred"] = True  # only a lower bound: unseen experts are not counted
    trace, dropped = _assemble(records, L, K, meta, has_weight, path)
    return ImportResult(trace, dropped, len(raw))


def _jsonl_record(rec: dict, where: str) -> tuple:
    missing = [k for k in ("layer", "experts", "token_idx") if k not in rec]
    if missing:
        raise TraceError(f"{where}: record lacks {', '.join(missing)}")
    layer, token, experts = rec["layer"], rec["token_idx"], rec["experts"]
    for name, value in (("layer", layer), ("token_idx", token)):
        if not _is_int(value) or value < 0:
            raise TraceError(f"{where}: {name!r} must be a whole number >= 0, got {value!r}")
    if not isinstance(experts, list) or not experts or not all(_is_int(e) for e in experts):
        raise TraceError(f"{where}: 'experts' must be a non-empty list of integer ids, got {experts!r}")
    if len(set(experts)) != len(experts):
        raise TraceError(f"{where}: 'experts' repeats an id: {experts}")
    weights = rec.get("weights")
    if weights is not None and (not isinstance(weights, list) or len(weights) != len(experts)
                                or not all(isinstance(w, (int, float)) for w in weights)):
        raise TraceError(f"{where}: 'weights' must be a list of {len(experts)} numbers like 'experts'")
    phase = rec.get("phase", 1)
    if phase not in (0, 1) or isinstance(phase, bool):
        raise TraceError(f"{where}: 'phase' must be 0 (prompt) or 1 (generation), got {phase!r}")
    return token, phase, layer, experts, weights


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- shared assembly --------------------------------------------------------------

def _assemble(records: list[tuple], L: int, K: int, meta: dict, has_weight: bool,
              path: Path) -> tuple[Trace, int]:
    """Records ``(token, phase, layer, rank, expert, weight, lineno)`` -> (Trace, dropped).

    Tokens keep their order of first appearance (route CSV) or sorted order (ints).
    """
    keys = list(dict.fromkeys(r[0] for r in records))
    if all(isinstance(k, int) for k in keys):
        keys.sort()
    index = {key: i for i, key in enumerate(keys)}
    T = len(keys)
    experts = np.full((L, T, K), -1, dtype=np.int32)   # L layers, T tokens, K ranks
    weights = np.zeros((L, T, K), dtype=np.float32)
    phase = np.full(T, -1, dtype=np.int8)
    seen_at = {}
    for token, ph, layer, rank, expert, weight, lineno in records:
        t = index[token]
        if (t, layer, rank) in seen_at:
            raise TraceError(f"{path}:{lineno}: token {token} layer {layer} rank {rank} already "
                             f"given on line {seen_at[(t, layer, rank)]}")
        seen_at[(t, layer, rank)] = lineno
        if phase[t] not in (-1, ph):
            raise TraceError(f"{path}:{lineno}: token {token} has phase {ph} here but "
                             f"{phase[t]} on an earlier line")
        phase[t] = ph
        experts[layer, t, rank] = expert
        weights[layer, t, rank] = weight if has_weight else 0.0
    complete = (experts >= 0).all(axis=(0, 2))
    dropped = int(T - complete.sum())
    if not complete.any():
        raise TraceError(f"{path}: no token covers all {L} layers x top_k {K}; nothing to import")
    ex = experts[:, complete]
    dup = np.sort(ex, axis=2)
    if (dup[..., 1:] == dup[..., :-1]).any():
        layer, t, _ = np.argwhere(dup[..., 1:] == dup[..., :-1])[0]
        raise TraceError(f"{path}: token {keys[np.flatnonzero(complete)[t]]} selects the same "
                         f"expert twice at layer {layer}")
    meta = {**meta, "dropped_tokens": dropped}
    trace = Trace(ex.astype(np.int16), meta,
                  weights[:, complete].astype(np.float16) if has_weight else None,
                  phase[complete].astype(np.uint8))
    return trace, dropped
