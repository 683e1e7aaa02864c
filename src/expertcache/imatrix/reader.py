"""Read llama.cpp importance-matrix files for their per-expert token counts.

An imatrix GGUF (``general.type = imatrix``) stores, per weight ``NAME``, F32
tensors ``NAME.in_sum2`` and ``NAME.counts``. For a MoE weight
(``blk.N.ffn_{gate,up,down,gate_up}_exps.weight``) ``counts`` has one entry per
expert: the calibration tokens routed to that expert in block N. That is the
only part this module needs. The legacy ``imatrix.dat`` keeps one call count
per tensor, so it cannot rank experts: it is recognised and explained, never
guessed from.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np

from .counts import ExpertCounts

GGUF_MAGIC = b"GGUF"
_EXPS_COUNTS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.weight\.counts$")
_KIND_ORDER = ("gate", "up", "gate_up", "down")
KV_DATASETS, KV_CHUNK_COUNT, KV_CHUNK_SIZE = "imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size"


class ImatrixError(ValueError):
    """An imatrix file that cannot give per-expert counts; the message says why and what to do."""


class LegacyImatrixError(ImatrixError):
    """A legacy ``imatrix.dat``: valid, but it holds no per-expert counts."""


def read(path: str | Path) -> ExpertCounts:
    """Per-MoE-layer expert counts ``[L, E]`` and metadata from an imatrix file.

    ``meta`` holds ``datasets`` (list of str), ``chunk_count``, ``chunk_size``
    (None when absent) and ``blocks`` (GGUF block number of each row).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"imatrix file not found: {path}")
    with open(path, "rb") as fh:
        head = fh.read(4)
    if head != GGUF_MAGIC:
        raise explain_non_gguf(path)
    reader = _open_gguf(path)
    fields = _fields(reader, path)
    gtype = fields.get("general.type")
    if gtype is not None and gtype != "imatrix":
        raise ImatrixError(f"{path}: a GGUF of type {gtype!r}, not an imatrix; pass the file "
                           "llama-imatrix wrote (-o imatrix.gguf)")
    per_block = _expert_counts_by_block(reader, path)
    blocks = sorted(per_block)
    widths = {len(per_block[b]) for b in blocks}
    if len(widths) != 1:
        detail = ", ".join(f"blk.{b}: {len(per_block[b])}" for b in blocks[:8])
        raise ImatrixError(f"{path}: MoE blocks disagree on the number of experts ({detail}); "
                           "the file mixes models or is corrupt")
    counts = np.stack([per_block[b] for b in blocks])
    _reject_flat(counts, path)
    meta = {"datasets": _as_list(fields.get(KV_DATASETS)),
            "chunk_count": fields.get(KV_CHUNK_COUNT), "chunk_size": fields.get(KV_CHUNK_SIZE),
            "blocks": blocks}
    return ExpertCounts(counts, source=str(path), kind="imatrix", meta=meta)


# -- GGUF -----------------------------------------------------------------------
def _open_gguf(path: Path):
    import gguf  # a dependency of the package; imported here so other sources do not pay for it

    try:
        reader = gguf.GGUFReader(path)
        size = path.stat().st_size
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    except (ValueError, IndexError, struct.error, OSError, KeyError) as err:
        raise ImatrixError(f"{path}: unreadable GGUF (truncated or corrupt?): {err}") from None
    if end > size:
        raise ImatrixError(f"{path}: truncated GGUF: tensor data runs to byte {end} but the file "
                           f"has {size}; copy or regenerate the file")
    return reader


def _fields(reader, path: Path) -> dict:
    out = {}
    for name, fld in reader.fields.items():
        try:
            out[name] = fld.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as err:
            raise ImatrixError(f"{path}: corrupt metadata field {name!r}: {err}") from None
    return out


def _expert_counts_by_block(reader, path: Path) -> dict[int, np.ndarray]:
    """block -> counts [E]; gate, up and down of a block must agree."""
    found: dict[int, dict[str, np.ndarray]] = {}
    any_counts = False
    for tensor in reader.tensors:
        any_counts |= tensor.name.endswith(".counts")
        match = _EXPS_COUNTS.match(tensor.name)
        if match:
            values = np.asarray(tensor.data, dtype=np.float64).reshape(-1)  # (E, 1) -> [E]
            found.setdefault(int(match.group(1)), {})[match.group(2)] = values
    if not found:
        if any_counts:
            raise ImatrixError(f"{path}: no expert tensors (blk.N.ffn_*_exps.weight.counts): this "
                               "imatrix comes from a dense model, so there are no experts to rank")
        raise ImatrixError(f"{path}: no '.counts' tensors at all; not an imatrix from llama-imatrix")
    return {block: _agree(block, kinds, path) for block, kinds in found.items()}


def _agree(block: int, kinds: dict[str, np.ndarray], path: Path) -> np.ndarray:
    names = sorted(kinds, key=_KIND_ORDER.index)  # compare against gate (or up) first
    ref = kinds[names[0]]
    for name in names[1:]:
        other = kinds[name]
        # Counts are integers stored as F32: equal unless the file was edited or damaged.
        if other.shape != ref.shape or not np.allclose(other, ref, rtol=1e-6, atol=0.5):
            diff = _first_difference(ref, other)
            raise ImatrixError(f"{path}: expert counts of blk.{block} disagree between ffn_{names[0]}_exps "
                               f"and ffn_{name}_exps ({diff}); every projection of a layer sees the same "
                               "routed tokens, so the file is inconsistent or corrupt")
    if not np.isfinite(ref).all() or (ref < 0).any():
        raise ImatrixError(f"{path}: blk.{block} has negative or non-finite expert counts")
    return np.rint(ref).astype(np.int64)


def _first_difference(a: np.ndarray, b: np.ndarray) -> str:
    if a.shape != b.shape:
        return f"{a.size} vs {b.size} experts"
    e = int(np.flatnonzero(~np.isclose(a, b, rtol=1e-6, atol=0.5))[0])
    return f"expert {e}: {a[e]:g} vs {b[e]:g} tokens"


def _reject_flat(counts: np.ndarray, path: Path) -> None:
    """Identical counts for every expert in every layer cannot rank anything.

    llama-imatrix broadcasts the single legacy count to all experts when it
    converts an old ``.dat``; real routing is never that even.
    """
    if counts.shape[1] > 1 and (counts == counts[:, :1]).all():
        raise ImatrixError(f"{path}: every expert of every layer has the same count; the file was "
                           "probably converted from a legacy imatrix.dat, which has no per-expert "
                           "counts. Regenerate it with llama-imatrix on a MoE model (GGUF output)")


def _as_list(value) -> list[str]:
    if value is None:
        return []
    return [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]


# -- legacy imatrix.dat ---------------------------------------------------------
def explain_non_gguf(path: Path) -> ImatrixError:
    """A LegacyImatrixError describing a legacy ``.dat``, or a plain ImatrixError."""
    data = path.read_bytes()
    try:
        info = parse_legacy(data)
    except ValueError as err:
        return ImatrixError(f"{path}: neither a GGUF imatrix nor a legacy imatrix.dat ({err}); "
                            "pass the file llama-imatrix wrote")
    moe = sum(1 for name in info["names"] if "_exps." in name)
    dataset = f", dataset {info['dataset']!r}" if info["dataset"] else ""
    return LegacyImatrixError(
        f"{path}: a legacy imatrix.dat ({len(info['names'])} tensors, {moe} of them MoE expert "
        f"tensors, {info['chunks']} chunks{dataset}). This format keeps one call count per tensor, "
        "not the tokens routed to each expert, so it cannot rank experts. Regenerate the imatrix with "
        "a current llama-imatrix (GGUF output: -o imatrix.gguf) or record a routing trace instead")


def parse_legacy(data: bytes) -> dict:
    """Walk a legacy ``.dat`` (little-endian); ValueError if the bytes do not fit the layout."""
    pos = 0

    def take(fmt: str):
        nonlocal pos
        size = struct.calcsize(fmt)
        if pos + size > len(data):
            raise ValueError(f"ends early at byte {pos}")
        out = struct.unpack_from(fmt, data, pos)
        pos += size
        return out

    (n_entries,) = take("<i")
    if not 0 < n_entries < 1_000_000:
        raise ValueError(f"implausible entry count {n_entries}")
    names = []
    for _ in range(n_entries):
        (length,) = take("<i")
        if not 0 < length <= 4096:
            raise ValueError(f"implausible name length {length}")
        names.append(bytes(take(f"<{length}s")[0]).decode("utf-8", errors="replace"))
        _ncall, nval = take("<ii")
        if nval < 0 or pos + 4 * nval > len(data):
            raise ValueError(f"implausible value count {nval}")
        pos += 4 * nval
    chunks, dataset = 0, ""
    if pos < len(data):  # newer legacy files append the chunk count and the dataset name
        (chunks,) = take("<i")
        if pos < len(data):
            (length,) = take("<i")
            if length < 0:
                raise ValueError(f"implausible dataset name length {length}")
            dataset = bytes(take(f"<{length}s")[0]).decode("utf-8", errors="replace")
    if pos != len(data):
        raise ValueError(f"{len(data) - pos} unexplained trailing bytes")
    return {"names": names, "chunks": chunks, "dataset": dataset}
