"""The slot pool's sizing: one rule for the runtime and ``expertcache plan``.

Which slot format and compute dtype a run uses, how many staging slots it keeps, what
one slot takes, what else the pool needs on the device and how many cache slots fit a
budget. The runtime resolves these once (``runtime/engine.py``) and ``plan`` asks the
same functions with the device it plans for, so the slots it promises are the slots
the run builds. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from .model import ExpertCost

# bytes per weight of each compute dtype (config.DTYPES names)
COMPUTE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def default_dtype(device_type: str) -> str:
    """The compute dtype of experts that carry no float dtype of their own (GGUF, MXFP4, FP8):
    bfloat16 on a GPU; float32 on the host, where bf16 matmuls are slow."""
    return "bfloat16" if device_type == "cuda" else "float32"


def resolve_slot_format(choice: str, quantized: bool, device_type: str, ggml: bool = False) -> str:
    """What the configured ``slot_format`` means for these experts on this device.

    Float experts: 'plain' ('quantized' makes no sense for them). Quantized ones: the
    choice, or for 'auto' quantized slots on a GPU (dequantizing a few MiB per use is
    memory bound, microseconds, and the pool holds 3-4x more experts) and on the host
    when ``ggml`` computes there (its kernels read the stored bytes: no dequantization at
    all, docs/cpu.md); dequantized slots on the host otherwise (dequantizing per use in
    torch costs more than the expert math there: docs/quantized.md)."""
    if not quantized:
        if choice not in ("auto", "dequantized"):
            raise ValueError(f"slot_format={choice!r} is for quantized experts; this model's experts are "
                             "already in a float dtype (use the default 'auto')")
        return "plain"
    if choice != "auto":
        return choice
    return "quantized" if device_type == "cuda" or ggml else "dequantized"


def staging_slots(miss: str, staging: int | None, top_k: int) -> int:
    """Slots that stream what a step needs beyond the cache: none when misses run on the
    CPU, else ``staging`` (default: top-k, one decode step's experts)."""
    return 0 if miss == "cpu" else (staging or top_k)


@dataclass(frozen=True)
class PoolSizing:
    """Device bytes of a pool of ``slot_format`` slots (resolved: plain, quantized, dequantized)."""

    cost: ExpertCost
    slot_format: str
    top_k: int
    staging: int
    direct: bool = False  # ggml computes on the 'quantized' slots' bytes: no scratch

    @property
    def slot_bytes(self) -> int:
        """One slot: the stored bytes in 'quantized' slots, else the compute dtype."""
        return self.cost.slot_bytes(self.slot_format)

    @property
    def scratch_experts(self) -> int:
        """Experts one step dequantizes at once with 'quantized' slots: a decode step's top-k
        (or the staging slots' count, if larger); prefill steps run in rounds of that many."""
        return max(self.top_k, self.staging) if self.slot_format == "quantized" and not self.direct else 0

    @property
    def extra_bytes(self) -> int:
        """Device bytes besides the slots: the per-step dequantization scratch ('quantized'
        slots) or the landing buffer one load is dequantized from ('dequantized' slots)."""
        if self.slot_format == "quantized":
            return self.scratch_experts * self.cost.compute_bytes  # 0 when ggml reads the slots
        return self.cost.expert_bytes if self.slot_format == "dequantized" and self.cost.quantized else 0

    def device_bytes(self, slots: int) -> int:
        """The whole pool: ``slots`` cache slots, the staging slots and the extra buffers."""
        return (slots + self.staging) * self.slot_bytes + self.extra_bytes

    def slots_in(self, budget: int) -> int:
        """Cache slots that fit ``budget`` bytes next to the staging slots and the extra buffers
        (may be negative: the budget does not even hold those)."""
        return (budget - self.extra_bytes) // self.slot_bytes - self.staging


def cap_slots(slots: int, layers: int, experts: int, partition: str) -> int:
    """Cache slots a pool actually gets: never more than there are experts (that would only
    waste memory), and whole slots per layer in a per-layer partition (the table refuses
    fewer than one per layer)."""
    slots = min(slots, layers * experts)
    if partition == "per-layer":
        slots = min(slots // layers, experts) * layers or slots
    return slots
