"""Model shapes of common MoE checkpoints (``../shared/CONTEXT.md`` section 2).

One row per model: MoE layers, experts per layer, top-k, hidden size, expert FF
size and bytes per weight. ``expert_bytes`` is one expert's gate + up + down
matrices (3 x hidden x FF weights); biases and scales outside the packed format
are ignored (under 0.2 % for GPT-OSS). The simulator, benchmarks and the
synthetic trace generator look shapes up here by name.
"""

from __future__ import annotations

from dataclasses import dataclass

BF16 = 2.0
MXFP4 = 17 / 32  # 32 four-bit weights plus one shared 8-bit exponent = 17 bytes


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int          # MoE layers
    experts: int         # routed experts per layer
    top_k: int           # experts each token selects per layer
    hidden: int
    expert_ff: int       # one expert's intermediate size
    dtype_bytes: float   # bytes per expert weight (2 for bf16, 17/32 for MXFP4)
    dtype: str = "bf16"

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert: gate, up and down projections."""
        return round(3 * self.hidden * self.expert_ff * self.dtype_bytes)

    @property
    def total_experts(self) -> int:
        return self.layers * self.experts

    @property
    def experts_bytes(self) -> int:
        """Bytes of all routed experts of the model (what offloading keeps in host RAM)."""
        return self.total_experts * self.expert_bytes


PRESETS: dict[str, ModelShape] = {m.name: m for m in (
    ModelShape("qwen3-30b-a3b", 48, 128, 8, 2048, 768, BF16),
    ModelShape("gpt-oss-120b", 36, 128, 4, 2880, 2880, MXFP4, "mxfp4"),
    ModelShape("gpt-oss-20b", 24, 32, 4, 2880, 2880, MXFP4, "mxfp4"),
    ModelShape("mixtral-8x7b", 32, 8, 2, 4096, 14336, BF16),
    ModelShape("olmoe", 16, 64, 8, 2048, 1024, BF16),
)}


def preset(name: str) -> ModelShape:
    """The shape called ``name``; a ValueError lists the known names otherwise."""
    if not isinstance(name, str):
        raise TypeError(f"preset name must be a string, got {type(name).__name__}")
    key = name.strip().lower()
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}")
    return PRESETS[key]
