"""Real expert weights for the benchmark: a preset's shape, scaled, random, in host RAM.

The experts are Qwen3-style SwiGLU (fused ``gate_up_proj [E, 2I, H]``, ``down_proj
[E, H, I]``) for every preset: the module that computes them is transformers' own
``Qwen3MoeExperts`` built on the meta device (no weights), so the runtime calls the
same ``_apply_gate`` a real Qwen3 model does. The weights live in ``HostExperts``,
one per MoE layer, exactly what ``offload()`` would have taken out of a model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..presets import ModelShape
from ..runtime.host import HostExperts, resident

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


ALIGN = 16  # elements: 64 bytes of fp32, a cache line


def _aligned(size: float) -> int:
    """A scaled size rounded to a multiple of 16 elements (at least 16).

    Why: every preset's real sizes are multiples of 16, and CPU matmul kernels round
    differently when rows or expert slots are not 64-byte aligned (seen on AMD EPYC:
    the same expert in two slots gave different bits), which would break the bench's
    check that every pool strategy computes bit for bit the same outputs."""
    return max(ALIGN, round(size / ALIGN) * ALIGN)


@dataclass(frozen=True)
class BenchShape:
    """The expert shape actually run: the preset's dims times ``scale``, in ``dtype``."""

    name: str
    layers: int
    experts: int
    top_k: int
    hidden: int
    expert_ff: int
    dtype: str

    @classmethod
    def from_preset(cls, shape: ModelShape, layers: int, scale: float, dtype: str) -> BenchShape:
        if dtype not in DTYPES:
            raise ValueError(f"unknown --dtype {dtype!r}; use one of {', '.join(DTYPES)}")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale <= 4:
            raise ValueError(f"--scale must be a number in (0, 4] multiplying hidden and expert FF "
                             f"sizes (e.g. 0.125 or 1), got {scale!r}")
        hidden, ff = _aligned(shape.hidden * scale), _aligned(shape.expert_ff * scale)
        return cls(shape.name, layers, shape.experts, shape.top_k, hidden, ff, dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.expert_ff  # gate, up, down

    @property
    def expert_bytes(self) -> int:
        return self.expert_params * torch.empty(0, dtype=self.torch_dtype).element_size()

    @property
    def host_bytes(self) -> int:
        return self.layers * self.experts * self.expert_bytes


def experts_module(shape: BenchShape) -> torch.nn.Module:
    """A weightless ``Qwen3MoeExperts``: the math (SwiGLU gate) without any tensors."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=shape.hidden, moe_intermediate_size=shape.expert_ff,
                            num_experts=shape.experts, num_experts_per_tok=shape.top_k,
                            hidden_act="silu")
    with torch.device("meta"):
        module = Qwen3MoeExperts(config)
    for kind in ("gate_up_proj", "down_proj"):
        delattr(module, kind)  # the runtime reads weights from HostExperts and the pool only
    return module.eval()


def host_experts(shape: BenchShape, seed: int = 0, pin: bool = False) -> list[HostExperts]:
    """Random experts for every layer: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``.

    Uniform weights with the variance of a 1/sqrt(fan_in) init keep the hidden vector's
    scale stable through the layers; ``pin`` makes CUDA slot loads true async DMA.
    """
    gen = torch.Generator().manual_seed(seed)
    E, H, I = shape.experts, shape.hidden, shape.expert_ff
    hosts = []
    for _ in range(shape.layers):
        up = _uniform((E, 2 * I, H), 3 ** 0.5 / H ** 0.5, shape.torch_dtype, gen)
        down = _uniform((E, H, I), 3 ** 0.5 / I ** 0.5, shape.torch_dtype, gen)
        mode = "pinned" if pin else "copy"
        hosts.append(HostExperts({"gate_up_proj": resident(up, mode), "down_proj": resident(down, mode)},
                                 mode=mode, mode_reason="random benchmark experts"))
    return hosts


def _uniform(size: tuple[int, ...], bound: float, dtype: torch.dtype,
             gen: torch.Generator) -> torch.Tensor:
    return torch.empty(size, dtype=dtype).uniform_(-bound, bound, generator=gen)
