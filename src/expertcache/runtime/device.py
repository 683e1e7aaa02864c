"""Which device a run uses, its memory, and the torch dtype of a compute-dtype name."""

from __future__ import annotations

import torch

from ..costmodel import default_dtype

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str | None) -> torch.device:
    """``name`` ('cuda', 'cuda:N', 'cpu') checked against this torch; None: CUDA when there is one."""
    if name is None:
        return default_device()
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}; use cuda, cuda:N or cpu") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but torch sees no CUDA device "
                         f"(torch {torch.__version__}); use device='cpu' or a CUDA build of torch")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device {name!r} is not supported yet; use cuda or cpu")
    return device


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def compute_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """The dtype quantized experts (and a GGUF model's dense part) compute in: ``name`` when
    given, else the device's default (``costmodel.default_dtype``, which ``plan`` sizes with)."""
    return DTYPES[name or default_dtype(device.type)]


def free_memory(device: torch.device) -> int | None:
    """Free bytes on the device (host: MemAvailable); None when it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as fh:
                for line in fh:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None
