"""Expert weights in host RAM: one tensor per weight kind ``[E, ...]`` per MoE layer.

The weights are taken out of a transformers experts module (its parameters are
deleted, so moving the model to the device leaves them behind) and pinned when CUDA
is present, which makes slot loads true asynchronous DMA copies.
"""

from __future__ import annotations

import torch

_FP8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
        if hasattr(torch, n)}
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def expert_kinds(module: torch.nn.Module) -> list[str]:
    """The weight kinds this experts module computes with (gated: gate_up; else up)."""
    first = "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"
    kinds = [first, "down_proj"]
    if getattr(module, "has_bias", False):
        kinds += [first + "_bias", "down_proj_bias"]
    return kinds


def check_layout(module: torch.nn.Module, where: str) -> None:
    """Refuse expert layouts the slot pool cannot copy slab by slab; say which layout it is."""
    names = [n for n, _ in module.named_parameters(recurse=False)] + \
            [n for n, _ in module.named_buffers(recurse=False)]
    # quantized experts are read from the checkpoint, not taken from a loaded model (whose
    # kernels may have swizzled them): integrations/hf_quant.py
    if any(n.endswith(("_scale_inv", "weight_scale")) for n in names):
        raise ValueError(f"{where}: FP8-quantised experts ({', '.join(sorted(names))}) cannot be taken from a "
                         "loaded model; pass the checkpoint directory to offload() (block FP8 stays quantized "
                         "in host memory) or load the model in bf16/fp16/fp32 (dtype=...)")
    if any(n.endswith(("_blocks", "_scales")) for n in names):
        raise ValueError(f"{where}: MXFP4-packed experts ({', '.join(sorted(names))}) cannot be taken from a "
                         "loaded model; pass the checkpoint directory to offload() (its MXFP4 experts stay "
                         "quantized in host memory)")
    for kind in expert_kinds(module):
        tensor = getattr(module, kind, None)
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{where}: experts module {type(module).__name__} has no {kind!r} tensor; "
                             f"supported layouts hold fused {', '.join(expert_kinds(module))} [experts, ...]")
        if tensor.dtype in _FP8 or "float8" in str(tensor.dtype):
            raise ValueError(f"{where}: FP8 experts ({kind} is {tensor.dtype}) cannot be taken from a loaded "
                             "model; pass the checkpoint directory to offload() (block FP8 stays quantized in "
                             "host memory) or load the model in bf16/fp16/fp32 (dtype=...)")
        if tensor.dtype not in _FLOATS:
            raise ValueError(f"{where}: experts stored as {tensor.dtype} ({kind}) are not supported; "
                             "only float32, float16 and bfloat16 experts can be cached")
        if tensor.ndim < 2 or tensor.shape[0] != module.num_experts:
            raise ValueError(f"{where}: {kind} has shape {tuple(tensor.shape)}; expected "
                             f"[num_experts={module.num_experts}, ...]")
        if tensor.device.type == "meta":
            raise ValueError(f"{where}: {kind} is on the meta device (weights not loaded); "
                             "load the checkpoint fully before offloading")


class HostExperts:
    """One MoE layer's experts in host memory: ``tensors[kind]`` is ``[E, ...]``.

    The slot pool copies ``tensors[kind][e]`` as it is; ``expert(e)`` gives the CPU miss
    path the weights to compute with. ``runtime/quantized.py`` has the quantized twin.
    """

    codec = None          # quantized hosts carry how their bytes become compute weights
    mode = "copy"         # where the host bytes live (quantized hosts may read an mmap)
    mode_reason = "weights taken from the loaded model"

    def __init__(self, tensors: dict[str, torch.Tensor], transposed: bool = False) -> None:
        self.tensors = tensors
        self.transposed = transposed  # GPT-OSS stores [in, out]; the math follows the host
        self.num_experts = next(iter(tensors.values())).shape[0]
        # bytes one expert occupies over all kinds: what a slot load moves over PCIe
        self.expert_bytes = sum(t[0].numel() * t.element_size() for t in tensors.values())

    @classmethod
    def take(cls, module: torch.nn.Module, pin: bool) -> HostExperts:
        """Move ``module``'s expert weights to host memory and delete them from the module."""
        tensors = {}
        for kind in expert_kinds(module):
            data = getattr(module, kind).detach().to("cpu").contiguous()
            if pin:  # pin_memory() raises on CPU-only torch, hence the flag
                data = data.pin_memory()
            tensors[kind] = data
            delattr(module, kind)
        return cls(tensors, transposed=getattr(module, "is_transposed", False))

    def restore(self, module: torch.nn.Module) -> None:
        """Put the weights back into ``module`` as parameters (undo ``take``)."""
        for kind, data in self.tensors.items():
            setattr(module, kind, torch.nn.Parameter(data, requires_grad=False))

    def layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """kind -> (shape of one expert, dtype): what a slot of the pool must hold."""
        return {k: (tuple(t.shape[1:]), t.dtype) for k, t in self.tensors.items()}

    def expert(self, expert: int) -> dict[str, torch.Tensor]:
        """Views of one expert's weights (no copy)."""
        return {k: t[expert] for k, t in self.tensors.items()}
