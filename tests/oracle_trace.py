"""Accesses as a libCacheSim ``oracleGeneral`` binary trace, to compare with its C replay.

Each request is 24 packed bytes: uint32 timestamp, uint64 object id, uint32
size, int64 index of the object's next request (-1 when none). libCacheSim
handles one request at a time (no step protection), so its results equal
ours only where every step needs one key; benchmarks compare speed on the
same accesses regardless.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

RECORD = np.dtype([("ts", "<u4"), ("id", "<u8"), ("size", "<u4"), ("next", "<i8")])


def flat_accesses(keys: np.ndarray) -> np.ndarray:
    """``int64 [N]``: step keys ``[S, K]`` flattened in rank order, repeats (-1) dropped."""
    flat = keys.reshape(-1).astype(np.int64)
    return flat[flat >= 0]


def write_oracle_general(seq: np.ndarray, path: str | Path) -> Path:
    """Write ``seq`` (object ids >= 0) with next-access indices; ids are shifted by 1."""
    seq = np.asarray(seq, dtype=np.int64)
    n = len(seq)
    nxt = np.full(n, -1, np.int64)
    order = np.lexsort((np.arange(n), seq))           # by id, then by position
    same = seq[order[1:]] == seq[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]           # next position with the same id
    rec = np.zeros(n, RECORD)
    rec["ts"] = np.arange(n, dtype=np.uint32)
    rec["id"] = seq + 1                                # keep clear of id 0
    rec["size"] = 1
    rec["next"] = nxt
    path = Path(path)
    rec.tofile(path)
    return path
