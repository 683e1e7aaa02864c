"""Where each tensor of a safetensors checkpoint lives: file, byte offset, size, dtype, shape
(torch-free); and the shape of its routed experts, for ``plan`` (``checkpoint_experts``).

The RAM tier (``host_memory='tiered'``, runtime/tiered.py) reads experts by offset with
``O_DIRECT`` instead of through ``safe_open``'s memory map. The ``safetensors`` package reads
the header but keeps the offsets to itself (``safe_open`` hands out tensors and slices, not
positions), so the header is read here: an 8-byte little-endian length N, N bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``, offsets relative to the end of
the header), then the data. The format is frozen (safetensors' README, "Format").
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

# safetensors dtype -> bytes per element
ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
              "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_MAX_HEADER = 100 * 2 ** 20  # safetensors itself refuses headers over 100 MB


@dataclass(frozen=True)
class StoredTensor:
    """One tensor's bytes in a checkpoint file (``offset`` from the start of the file)."""

    file: Path
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (its index's shards, or model.safetensors)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except json.JSONDecodeError as err:
            raise ValueError(f"{index}: not valid JSON ({err}); the checkpoint's index is damaged") from None
        return [path / f for f in sorted(set(weight_map.values()))]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    raise ValueError(f"{path}: host_memory='tiered' reads experts by offset from safetensors files; this "
                     "checkpoint has none (model.safetensors or model.safetensors.index.json). Re-save it "
                     "with save_pretrained (safetensors is its default)")


def stored_tensors(path: Path) -> dict[str, StoredTensor]:
    """Every tensor of the checkpoint directory ``path``, by name."""
    out: dict[str, StoredTensor] = {}
    for file in checkpoint_files(path):
        out.update(read_header(file))
    return out


def read_header(file: Path) -> dict[str, StoredTensor]:
    """The tensors of one safetensors file; a damaged or truncated file is refused in one line."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{file}: {size} bytes, too short for a safetensors header; the file is truncated")
        (length,) = struct.unpack("<Q", head)
        if length > min(_MAX_HEADER, size - 8):
            raise ValueError(f"{file}: its header claims {length} bytes but the file has {size}; "
                             "not a safetensors file, or truncated")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{file}: the safetensors header is not valid JSON ({err}); the file is damaged") from None
    base = 8 + length
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in entry["data_offsets"])
            dtype, shape = str(entry["dtype"]), tuple(int(d) for d in entry["shape"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{file}: header entry {name!r} lacks dtype, shape or data_offsets; "
                             "the file is damaged") from None
        if dtype in ITEM_BYTES and end - begin != math.prod(shape) * ITEM_BYTES[dtype]:
            raise ValueError(f"{file}: {name} is {dtype} {list(shape)} but spans {end - begin} bytes; "
                             "the file is damaged")
        if base + end > size:
            raise ValueError(f"{file}: {name} ends at byte {base + end} but the file has {size}; "
                             "the file is truncated")
        out[name] = StoredTensor(file, base + begin, end - begin, dtype, shape)
    return out


# an expert's tensor: ``...layers.L.<anything>experts.E.<rest>`` (one per expert), or a stacked
# ``...layers.L.<anything>experts.<name>`` [E, ...] (GPT-OSS, GraniteMoE, fused FP8)
_PER_EXPERT = re.compile(r"layers\.(\d+)\..*experts\.(\d+)\.")
_STACKED = re.compile(r"layers\.(\d+)\..*experts\.[a-z_]+$")
_NOT_WEIGHTS = ("_scale_inv", "_scales", "bias")   # scales and biases: bytes, not parameters


@dataclass(frozen=True)
class CheckpointExperts:
    """The routed experts of a checkpoint: MoE layers, experts each, top-k, one expert's stored
    bytes (every tensor of it: weights, scales, biases), its weights' parameters, their dtypes."""

    layers: int
    experts: int
    top_k: int
    expert_bytes: int
    params: int
    dtypes: str


def checkpoint_experts(path: Path) -> CheckpointExperts:
    """Read from config.json and the safetensors headers alone (no tensor is read). MXFP4's
    blocks count two parameters a byte."""
    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: no readable config.json ({err}); give a checkpoint directory") from None
    top_k = config.get("num_experts_per_tok") or config.get("moe_topk")
    layers: dict[int, dict[int, list[tuple[str, int, int]]]] = {}  # layer -> expert -> (name, bytes, params)
    stored = stored_tensors(path)
    for name, t in stored.items():
        if m := _PER_EXPERT.search(name):
            layers.setdefault(int(m[1]), {}).setdefault(int(m[2]), []).append((name, t.nbytes, _params(name, t.shape)))
        elif (m := _STACKED.search(name)) and len(t.shape) >= 2:
            per = layers.setdefault(int(m[1]), {})
            for e in range(t.shape[0]):                   # each expert its slice of the stack
                per.setdefault(e, []).append((name, t.nbytes // t.shape[0], _params(name, t.shape[1:])))
    if not layers or not top_k:
        why = "no expert tensors" if not layers else "no num_experts_per_tok in config.json"
        raise ValueError(f"{path}: {why}; plan sizes MoE checkpoints (experts.N.* or stacked experts.* tensors)")
    first = layers[min(layers)]
    parts = first[min(first)]
    dtypes = {stored[name].dtype for name, _, n in parts if n}
    return CheckpointExperts(len(layers), len(first), int(top_k), sum(b for _, b, _ in parts),
                             sum(n for _, _, n in parts), "/".join(sorted(dtypes)))


def _params(name: str, shape: tuple[int, ...]) -> int:
    if any(k in name for k in _NOT_WEIGHTS) and not name.endswith("_blocks"):
        return 0
    return math.prod(shape) * (2 if name.endswith("_blocks") else 1)   # MXFP4: 2 weights a byte
