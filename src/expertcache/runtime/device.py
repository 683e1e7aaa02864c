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


def host_room() -> int | None:
    """Bytes of RAM this process can still take: ``MemAvailable``, or its memory cgroup's room
    (``cgroup_room``) where that is less (a container's limit binds before the machine's RAM)."""
    free, room = free_memory(torch.device("cpu")), cgroup_room()
    if room is None:
        return free
    return room if free is None else min(free, room)


def cgroup_room() -> int | None:
    """Bytes this process's memory cgroup may still charge (limit - usage; v2 ``memory.max`` or
    v1 ``memory.limit_in_bytes``), or None without a limit. Usage counts the page cache too, so
    this is the room before the kernel must reclaim or kill."""
    try:
        with open("/proc/self/cgroup") as fh:
            lines = [line.strip().split(":", 2) for line in fh]
    except OSError:
        return None
    for _, controllers, path in lines:
        path = path.rstrip("/")
        if controllers == "":                                        # v2
            files = (f"/sys/fs/cgroup{path}/memory.max", f"/sys/fs/cgroup{path}/memory.current")
        elif "memory" in controllers.split(","):                     # v1
            base = f"/sys/fs/cgroup/memory{path}"
            files = (f"{base}/memory.limit_in_bytes", f"{base}/memory.usage_in_bytes")
        else:
            continue
        try:
            limit, usage = (open(f).read().strip() for f in files)
        except OSError:
            continue
        if limit.isdigit() and int(limit) < 1 << 60:                  # v1 says "no limit" as ~2^63
            return max(int(limit) - int(usage), 0)
    return None


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
