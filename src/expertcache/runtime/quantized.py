"""Quantized experts in host memory: each expert's bytes per part, and how they become weights.

A GGUF file stores one MoE layer's experts as a few tensors (``ffn_gate_exps``,
``ffn_up_exps``, ``ffn_down_exps`` or a fused ``ffn_gate_up_exps``, GPT-OSS adds
biases), each ``[E, rows, row_bytes]`` with the blocks along the row: one expert's
bytes of one tensor are one contiguous slice. A *part* is one such tensor; a
``Codec`` says how the parts of one expert become the weights a transformers experts
module computes with (``gate_up_proj [2I, H]``, ``down_proj [H, I]``, biases), always
``[out, in]``. The slot pool copies parts as bytes; dequantization happens on the
device (``quant.dequant``: torch, equal to gguf-py bit for bit).

HF-native checkpoints use the same classes (``loaders/hf_quant.py``): GPT-OSS's
MXFP4 experts repacked into ggml MXFP4 parts, block-FP8 experts as raw float8 parts,
each with a float32 scale part, joined by ``'fp8'`` (``quant.hf.fp8_block``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..quant.dequant import dequantize
from ..quant.formats import QuantFormat
from ..quant.hf import FP8_E4M3, fp8_block

# How a compute kind is built from its parts, stacked on dim 1 of [n, rows, ...]:
# 'one' takes a single part, 'concat' puts gate rows before up rows (Qwen, HF's
# gate_up_proj), 'interleave' alternates them row by row (GPT-OSS's _apply_gate
# reads gate from even and up from odd outputs), 'fp8' takes (weight, scale) pairs of
# parts, dequantizes each by ``Kind.block`` tiles and puts their rows one after another.
JOINS = ("one", "concat", "interleave", "fp8")


@dataclass(frozen=True)
class Part:
    """One stored tensor of an expert: ``shape`` in elements (rows, cols) or (cols,) for a bias."""

    name: str
    fmt: QuantFormat
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.fmt.nbytes(self.shape)

    @property
    def elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Kind:
    """One compute weight (e.g. ``gate_up_proj``): which parts, joined how."""

    name: str
    join: str
    parts: tuple[str, ...]
    block: tuple[int, int] | None = None  # 'fp8': rows x cols of one scale tile

    @property
    def weights(self) -> tuple[str, ...]:
        """The parts whose rows make up this weight ('fp8': every other part is a scale)."""
        return self.parts[::2] if self.join == "fp8" else self.parts


@dataclass(frozen=True)
class Codec:
    """How one expert's stored parts become its compute weights (same for every layer)."""

    parts: tuple[Part, ...]
    kinds: tuple[Kind, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        names = {p.name for p in self.parts}
        for kind in self.kinds:
            if kind.join not in JOINS or not set(kind.parts) <= names:
                raise ValueError(f"bad codec kind {kind}")
            fp8 = kind.join == "fp8"
            if fp8 != (kind.block is not None) or (fp8 and (len(kind.parts) % 2 or any(
                    self.part[w].fmt != FP8_E4M3 for w in kind.weights))):
                raise ValueError(f"bad codec kind {kind}: 'fp8' takes ({FP8_E4M3.name} weight, scale) "
                                 "pairs and a block")

    @property
    def part(self) -> dict[str, Part]:
        return {p.name: p for p in self.parts}

    @property
    def expert_bytes(self) -> int:
        """Stored bytes of one expert: what a load moves."""
        return sum(p.nbytes for p in self.parts)

    @property
    def params(self) -> int:
        """Elements of one expert's compute weights (scale parts are not parameters)."""
        return sum(math.prod(shape) for shape, _ in self.compute_layout().values())

    @property
    def compute_bytes(self) -> int:
        """One expert dequantized into the compute dtype."""
        return self.params * torch.empty((), dtype=self.dtype).element_size()

    def byte_layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """What a 'quantized' slot holds: each part's bytes."""
        return {p.name: ((p.nbytes,), torch.uint8) for p in self.parts}

    def compute_layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """What a 'dequantized' slot holds: each compute weight in the compute dtype."""
        part = self.part
        out = {}
        for kind in self.kinds:
            first = part[kind.weights[0]].shape
            rows = sum(part[p].shape[0] for p in kind.weights)
            out[kind.name] = ((rows, *first[1:]), self.dtype)
        return out

    def decode(self, data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Compute weights of n experts from their parts' bytes ``data[part]`` [n, nbytes]."""
        part = self.part

        def floats(name: str, dtype: torch.dtype) -> torch.Tensor:  # n experts, shape (rows, cols) or (cols,)
            return dequantize(data[name], part[name].fmt, (data[name].shape[0], *part[name].shape), dtype)

        out = {}
        for kind in self.kinds:
            if kind.join == "fp8":  # rows of each (weight, scale) pair, one after another
                pairs = [_fp8(data[w], part[w], floats(s, torch.float32), kind.block, self.dtype)
                         for w, s in zip(kind.parts[::2], kind.parts[1::2])]
                out[kind.name] = pairs[0] if len(pairs) == 1 else torch.cat(pairs, dim=1)
            else:
                out[kind.name] = _join(kind, [floats(p, self.dtype) for p in kind.parts])
        return out


def _fp8(raw: torch.Tensor, part: Part, scale: torch.Tensor, block: tuple[int, int],
         dtype: torch.dtype) -> torch.Tensor:
    """n experts' raw float8 bytes [n, rows * cols] times their tile scales -> [n, rows, cols]."""
    weight = raw.view(torch.float8_e4m3fn).reshape(raw.shape[0], *part.shape)
    return fp8_block(weight, scale, block, dtype)


def _join(kind: Kind, tensors: list[torch.Tensor]) -> torch.Tensor:
    if kind.join == "one":
        return tensors[0]
    if kind.join == "concat":
        return torch.cat(tensors, dim=1)                      # [n, 2I, ...]: gate rows, then up rows
    stacked = torch.stack(tensors, dim=2)                     # [n, I, 2, ...]
    return stacked.reshape(stacked.shape[0], -1, *stacked.shape[3:])  # [n, 2I, ...] alternating


class QuantExperts:
    """One MoE layer's quantized experts on the host: ``tensors[part]`` is ``[E, nbytes]`` uint8.

    The tensors are either copies in RAM (pinned when CUDA is there) or views of the
    memory-mapped model file; ``mode`` and ``mode_reason`` say which and why.
    """

    transposed = False  # decoded weights are [out, in], whatever the model's own layout

    def __init__(self, tensors: dict[str, torch.Tensor], codec: Codec, mode: str, mode_reason: str) -> None:
        self.tensors, self.codec = tensors, codec
        self.mode, self.mode_reason = mode, mode_reason
        self.num_experts = next(iter(tensors.values())).shape[0]
        self.expert_bytes = codec.expert_bytes

    def expert(self, expert: int) -> dict[str, torch.Tensor]:
        """One expert's compute weights, dequantized on the host (the CPU miss path)."""
        decoded = self.codec.decode({k: t[expert:expert + 1] for k, t in self.tensors.items()})
        return {k: t[0] for k, t in decoded.items()}

    def restore(self, module: torch.nn.Module) -> None:
        """Nothing to hand back: a GGUF model's experts modules never held weights."""
