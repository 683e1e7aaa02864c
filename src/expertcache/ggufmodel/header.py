"""A GGUF MoE model's header: architecture, shapes and expert tensors, without loading weights.

Torch-free: ``plan``, ``sim --model`` and ``loaders/gguf.py`` share it. ``reader.py`` parses
the header (tensor data is not read; gguf-py's ``GGUFReader`` took ~11 s on a real
vocabulary, see there). Split models (``name-00001-of-00003.gguf``) are read part by part;
every part must be there.
Expert tensors are ``blk.N.ffn_{gate,up,down}_exps.weight`` (or a fused
``ffn_gate_up_exps``; GPT-OSS adds ``.bias``), numpy order ``[E, rows, cols]``: one
expert's bytes of one tensor are one contiguous slice (CONTEXT.md, section 6).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ..quant.formats import QuantFormat, check_supported, quant_format
from .reader import read_gguf

# GGUF architecture -> transformers model_type: the MoE architectures loaded from GGUF (the config
# from transformers' GGUF mapping, or for gpt-oss, llama, olmoe and deepseek2 from llama.cpp's keys:
# loaders/gguf.py). llama.cpp writes Mixtral as ``llama`` with experts; a ``llama`` file without
# experts is a dense model, refused as such. ``deepseek2`` is DeepSeek-V2/V3/R1 and Kimi-K2's
# arch; its sigmoid-routed files (V3, R1, Kimi-K2) load as transformers' DeepSeek-V3.
SUPPORTED_ARCHS = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "gpt-oss": "gpt_oss", "llama": "mixtral",
                   "olmoe": "olmoe", "deepseek2": "deepseek_v3"}
_EXPERT = re.compile(r"^blk\.(\d+)\.ffn_(gate_up|gate|up|down)_exps\.(weight|bias)$")
# the vocabulary: by far the largest metadata, and not needed to run the model (the tokenizer
# reads it from the file itself)
VOCAB_ARRAYS = frozenset({"tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                          "tokenizer.ggml.scores"})
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor's bytes are: ``file`` at ``offset`` (absolute), ``shape`` numpy order."""

    name: str
    file: Path
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    fmt: QuantFormat


@dataclass(frozen=True)
class GgufModel:
    """What the cache needs to know of a GGUF MoE model before touching its weights."""

    paths: tuple[Path, ...]
    arch: str
    metadata: dict = field(repr=False)
    tensors: dict[str, TensorRef] = field(repr=False)
    experts: dict[int, dict[str, TensorRef]] = field(repr=False)  # block -> 'gate.weight' -> tensor

    @property
    def model_type(self) -> str:
        return SUPPORTED_ARCHS[self.arch]

    @property
    def moe_blocks(self) -> list[int]:
        return sorted(self.experts)

    @property
    def num_experts(self) -> int:
        return next(iter(self.first_layer.values())).shape[0]

    @property
    def top_k(self) -> int:
        return int(self.metadata[f"{self.arch}.expert_used_count"])

    @property
    def first_layer(self) -> dict[str, TensorRef]:
        return self.experts[self.moe_blocks[0]]

    @property
    def hidden(self) -> int:
        return self.first_layer["down.weight"].shape[1]

    @property
    def expert_ff(self) -> int:
        """One expert's intermediate size, from the shapes (the metadata key is not always read)."""
        return self.first_layer["down.weight"].shape[2]

    def layer_expert_bytes(self, block: int) -> int:
        """Stored bytes of one expert of ``block``, every part (weights and biases)."""
        return sum(t.nbytes // t.shape[0] for t in self.experts[block].values())

    @property
    def expert_bytes(self) -> int:
        """Stored bytes of the largest layer's expert: what a quantized slot must hold.

        llama.cpp's Q4_K_M mixes types by layer (ffn_down_exps in Q6_K in half the layers,
        Q4_K in the rest), so experts of different layers differ in size."""
        return max(self.layer_expert_bytes(b) for b in self.experts)

    @property
    def mean_expert_bytes(self) -> float:
        return sum(self.layer_expert_bytes(b) for b in self.experts) / len(self.experts)

    @property
    def expert_params(self) -> int:
        total = 0
        for t in self.first_layer.values():
            n = 1
            for d in t.shape[1:]:
                n *= d
            total += n
        return total

    @property
    def quant_types(self) -> dict[str, str]:
        """Part -> quant type names over all layers, e.g. {'gate.weight': 'Q4_K', 'down.weight': 'Q4_K/Q6_K'}."""
        return {part: "/".join(sorted({layer[part].fmt.name for layer in self.experts.values()}))
                for part in self.first_layer}

    @property
    def experts_bytes(self) -> int:
        """All routed experts of the model: what the host tier holds."""
        return sum(self.layer_expert_bytes(b) for b in self.experts) * self.num_experts


def is_gguf(path: Path) -> bool:
    """A .gguf path (existing or not), or any file that starts with the GGUF magic."""
    if path.suffix.lower() == ".gguf":
        return True
    if path.is_file():
        with open(path, "rb") as fh:
            return fh.read(4) == b"GGUF"
    return False


def read_header(path: str | Path) -> GgufModel:
    """Read a GGUF MoE model's header; a clear ValueError for anything expertcache cannot run."""
    paths = split_parts(Path(path))
    metadata, tensors = {}, {}
    for part in paths:
        meta, refs = _read_one(part)
        metadata = metadata or meta
        tensors.update(refs)
    arch = metadata.get("general.architecture")
    experts = _expert_tensors(tensors)
    _check_model(paths[0], arch, metadata, experts)
    return GgufModel(paths, arch, metadata, tensors, experts)


def split_parts(path: Path) -> tuple[Path, ...]:
    """The file, or every part of a split model given its first part."""
    if not path.exists():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    if not path.is_file():
        raise ValueError(f"{path} is not a file; give the .gguf model file (the first part of a split one)")
    match = _SPLIT.match(path.name)
    if not match:
        return (path,)
    count = int(match["count"])
    if int(match["no"]) != 1:
        raise ValueError(f"{path.name} is part {int(match['no'])} of a split GGUF; give the first part "
                         f"({match['stem']}-00001-of-{match['count']}.gguf)")
    parts = tuple(path.with_name(f"{match['stem']}-{i:05d}-of-{match['count']}.gguf") for i in range(1, count + 1))
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise ValueError(f"split GGUF {path.name}: {len(missing)} of {count} parts missing "
                         f"({', '.join(missing)}); download every part into {path.parent}")
    return parts


def _read_one(path: Path) -> tuple[dict, dict[str, TensorRef]]:
    try:  # the vocabulary arrays are large and not needed here: stepped over, not decoded
        gfile = read_gguf(path, skip=VOCAB_ARRAYS)
    except OSError as err:
        raise ValueError(f"{path}: not a readable GGUF file ({err}); it may be truncated or not GGUF "
                         "at all: download it again") from None
    metadata = {name: f.value for name, f in gfile.fields.items() if name not in VOCAB_ARRAYS}
    size = path.stat().st_size
    refs = {}
    for t in gfile.tensors:
        end = t.data_offset + t.n_bytes
        if end > size:
            raise ValueError(f"{path}: truncated: tensor {t.name} ends at byte {end} but the file has "
                             f"{size} bytes; download it again")
        shape = tuple(reversed(t.shape))  # GGUF lists dims innermost first
        refs[t.name] = TensorRef(t.name, path, t.data_offset, t.n_bytes, shape, quant_format(int(t.tensor_type)))
    return metadata, refs


def _expert_tensors(tensors: dict[str, TensorRef]) -> dict[int, dict[str, TensorRef]]:
    experts: dict[int, dict[str, TensorRef]] = {}
    for name, ref in tensors.items():
        m = _EXPERT.match(name)
        if m:
            experts.setdefault(int(m[1]), {})[f"{m[2]}.{m[3]}"] = ref
    return experts


def _check_model(path: Path, arch, metadata: dict, experts: dict) -> None:
    if metadata.get("general.type") == "imatrix" or any(k.startswith("imatrix.") for k in metadata):
        raise ValueError(f"{path.name} is a llama.cpp imatrix file, not a model; pass it as "
                         "--imatrix next to the model file")
    if not arch:
        raise ValueError(f"{path.name}: no general.architecture in the GGUF metadata; not a model file")
    if not experts:
        raise ValueError(f"{path.name}: a dense model (architecture {arch!r}, no ffn_*_exps expert tensors); "
                         "expertcache needs a Mixture-of-Experts model")
    if arch not in SUPPORTED_ARCHS:
        count = metadata.get(f"{arch}.expert_count")
        raise ValueError(f"{path.name}: GGUF architecture {arch!r}{f' ({count} experts)' if count else ''} is not "
                         f"supported: expertcache reads MoE GGUF files of {', '.join(SUPPORTED_ARCHS)} only "
                         "(llama: Mixtral; deepseek2: DeepSeek-V3/R1, Kimi-K2)")
    first = experts[min(experts)]
    has_gate = "gate_up.weight" in first or {"gate.weight", "up.weight"} <= set(first)
    if not has_gate or "down.weight" not in first:
        raise ValueError(f"{path.name}: expert tensors of block {min(experts)} are incomplete "
                         f"({', '.join(sorted(first))}); expected gate, up (or gate_up) and down")
    for block, parts in experts.items():  # types may differ by layer (Q4_K_M), shapes may not
        if {k: v.shape for k, v in parts.items()} != {k: v.shape for k, v in first.items()}:
            raise ValueError(f"{path.name}: block {block}'s experts differ in shape from block "
                             f"{min(experts)}'s; one slot pool needs the same expert shapes in every layer")
        for part, ref in parts.items():
            check_supported(ref.fmt, ref.name)
    if f"{arch}.expert_used_count" not in metadata:
        raise ValueError(f"{path.name}: no {arch}.expert_used_count (top-k) in the metadata")
