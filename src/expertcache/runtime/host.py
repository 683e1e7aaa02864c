"""Expert weights in host memory: the only code that builds the host tier's tensors.

Every loader (``loaders/``) and the benchmark hand their expert tensors here:
``host_mode`` decides where the bytes live ('pinned' with a CUDA device, which makes
slot loads true asynchronous DMA copies; 'copy' in plain RAM; 'mmap' a GGUF file's
own bytes, the OS page cache being the middle tier), ``resident`` and ``file_bytes``
build them so. ``HostExperts`` holds one MoE layer of float experts, ``[E, ...]`` per
weight kind, taken out of a transformers experts module (its parameters are deleted,
so moving the model to the device leaves them behind); ``runtime/quantized.py`` has
the quantized twin.
"""

from __future__ import annotations

import mmap
import weakref

import numpy as np
import torch

from ..sizes import format_size
from .device import free_memory

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
    # kernels may have swizzled them): loaders/hf_quant.py
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


def host_mode(choice: str, device: torch.device, what: str, file_bytes: int | None = None) -> tuple[str, str]:
    """Where expert bytes live on the host ('pinned', 'copy' or 'mmap') and why.

    ``choice`` is ``CacheConfig.host_memory``; ``what`` names the experts in the reason.
    Only a file's own bytes (``file_bytes``: their size; GGUF) can stay memory-mapped.
    """
    cuda = device.type == "cuda"
    if choice == "tiered":  # the loaders build the tier themselves; a model passed in loaded reaches here
        raise ValueError(f"host_memory='tiered' reads experts by offset from a GGUF file or a safetensors "
                         f"checkpoint directory; these are {what} (pass the model's path instead, or use "
                         "host_memory='auto' or 'copy')")
    if file_bytes is None:
        if choice == "mmap":
            raise ValueError(f"host_memory='mmap' reads experts from a GGUF file; these are {what}, held "
                             "in RAM (use 'auto' or 'copy')")
        return ("pinned", f"{what}; pinned for DMA") if cuda else ("copy", what)
    free = free_memory(torch.device("cpu"))
    need = f"the experts take {format_size(file_bytes)}"
    have = "unknown" if free is None else format_size(free)
    if choice == "mmap":
        return "mmap", f"host_memory='mmap' asked for; {need}, read through the OS page cache"
    if choice == "copy":
        if free is not None and file_bytes > free:
            raise ValueError(f"host_memory='copy': {need} but only {have} of RAM is free; use "
                             "host_memory='mmap' (the OS page cache then holds what fits)")
        return ("pinned" if cuda else "copy"), f"host_memory='copy' asked for; {need}"
    # past 80% of the free RAM the page cache is the middle tier: say what beat it (docs/tiers.md,
    # a file larger than RAM: 1.3-1.5x mmap's tok/s, 10-12x in one memory limit)
    big = free is not None and file_bytes > 0.8 * free
    hint = "" if not big else (f"; {need}, more than 80% of the {have} of free RAM: host_memory='tiered', "
                               "host_budget='auto' keeps a RAM tier of experts under its own policy instead "
                               "(docs/tiers.md)")
    if not cuda:
        return "mmap", (f"no CUDA device, so nothing to pin: the slot pool copies straight from the "
                        f"memory-mapped file ({need})" + hint)
    if big:
        return "mmap", "read from the memory-mapped file, the OS page cache is the middle tier" + hint
    return "pinned", f"{need} and fit in the {have} of free RAM: pinned copies, full-speed DMA"


def resident(data: torch.Tensor, mode: str) -> torch.Tensor:
    """``data`` (any device) as a contiguous host tensor, page-locked when ``mode`` is 'pinned'."""
    data = data.detach()
    if mode == "pinned":  # pinning raises on CPU-only torch
        # already page-locked host memory (experts handed back by an earlier offload): no copy
        done = data.device.type == "cpu" and data.is_contiguous() and data.is_pinned()
        return data if done else pinned_copy(data)
    return data.to("cpu").contiguous()


# below this, torch's pinned allocator: its power-of-two rounding costs little there
_REGISTER_MIN = 1 << 20
_PORTABLE, _MAPPED = 1, 2  # cudaHostRegister flags
_HUGE = 2 << 20  # a transparent huge page on x86_64 and aarch64 (4 KiB base pages)
_PAGE = 4096


def huge_map(size: int) -> np.ndarray:
    """``size`` bytes of a fresh anonymous map (zeros), 2 MiB-aligned, advised to use huge pages:
    the kernel then faults and pins it 2 MiB at a time (where transparent huge pages are off or
    'never' it changes nothing). The array holds the map."""
    m = mmap.mmap(-1, size + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # no THP here: 4 KiB pages, as numpy's would be
        pass
    raw = np.frombuffer(m, np.uint8)
    skip = -raw.ctypes.data % _HUGE
    return raw[skip:skip + size]


def zeroed(nbytes: int, pinned: bool = False) -> torch.Tensor:
    """``[nbytes]`` uint8 zeros, every page touched now (the memory is committed at the call, not
    as it is first written), on huge pages where the kernel gives them; page-locked (``pinned``)
    in place: ``pinned_copy`` of zeros held the budget twice until the copy was done. 15 GiB on
    the 2-core EPYC sandbox (a VM whose memory is backed as it is first touched), a fresh process
    after the page cache was dropped: 7.4-13.2 s here, 8.3-11.7 s ``torch.zeros``, 8.2-12.2 s a
    ``MAP_POPULATE`` map (2 rounds each): the first touch costs the same whatever makes it."""
    arr = huge_map(nbytes)
    arr[::_PAGE] = 0  # each page faulted in (a write: a read would map the shared zero page)
    out = torch.from_numpy(arr)
    if pinned and not _register(out, arr):
        return torch.zeros(nbytes, dtype=torch.uint8).pin_memory()
    return out


def pinned_copy(data: torch.Tensor) -> torch.Tensor:
    """A page-locked host copy of ``data`` (any device), in one copy, sized to the byte.

    ``Tensor.pin_memory()`` copies into torch's caching host allocator, which rounds every block
    up to a power of two (805 MB of experts took 1 GiB), after a first copy to the host when the
    data is elsewhere. Large tensors here get their own anonymous mapping (page-aligned, no page
    shared with anything else), locked with ``cudaHostRegister`` and unlocked when the tensor is
    freed; the data is copied into it once, from wherever it is.
    """
    nbytes = data.numel() * data.element_size()
    if nbytes < _REGISTER_MIN:
        return data.to("cpu").contiguous().pin_memory()
    buf = mmap.mmap(-1, nbytes)
    out = torch.frombuffer(buf, dtype=data.dtype, count=data.numel()).view(data.shape)
    if not _register(out, buf):
        return data.to("cpu").contiguous().pin_memory()
    return out.copy_(data)


def _register(out: torch.Tensor, buf) -> bool:
    """Page-lock ``out`` (all of ``buf``'s map, or part of it) with ``cudaHostRegister``, unlocked
    when ``out`` is freed; False if CUDA refused."""
    cudart = torch.cuda.cudart()
    # portable (every device) and mapped: the device step reads the store in place (devicestep.cuda_view)
    if int(cudart.cudaHostRegister(out.data_ptr(), out.numel() * out.element_size(), _PORTABLE | _MAPPED)) != 0:
        if hasattr(cudart, "cudaGetLastError"):
            cudart.cudaGetLastError()  # the error is ours: no later kernel check may report it
        return False
    # the finalizer holds the mapping, so the pages outlive their registration
    weakref.finalize(out, _unregister, out.data_ptr(), buf)
    return True


def _unregister(ptr: int, buf) -> None:  # buf: the map, held until now
    torch.cuda.cudart().cudaHostUnregister(ptr)


def file_bytes(file, offset: int, experts: int, nbytes: int, mode: str) -> torch.Tensor:
    """``[E, nbytes]`` uint8 from a file: a view of it ('mmap'), or read into RAM ('copy', 'pinned')."""
    # copy-on-write mapping: torch gets a writable view without reading or copying the file
    view = torch.from_numpy(np.memmap(file, dtype=np.uint8, mode="c", offset=offset, shape=(experts, nbytes)))
    if mode == "mmap":
        return view
    return pinned_copy(view) if mode == "pinned" else view.clone()  # one copy, out of the file


class HostExperts:
    """One MoE layer's experts in host memory: ``tensors[kind]`` is ``[E, ...]``.

    The slot pool copies ``tensors[kind][e]`` as it is; ``expert(e)`` gives the CPU miss
    path the weights to compute with. ``runtime/quantized.py`` has the quantized twin.
    """

    codec = None          # quantized hosts carry how their bytes become compute weights

    def __init__(self, tensors: dict[str, torch.Tensor], transposed: bool = False, mode: str = "copy",
                 mode_reason: str = "weights taken from the loaded model") -> None:
        self.tensors = tensors
        self.transposed = transposed  # GPT-OSS stores [in, out]; the math follows the host
        self.mode, self.mode_reason = mode, mode_reason  # where the host bytes live, and why
        self.num_experts = next(iter(tensors.values())).shape[0]
        # bytes one expert occupies over all kinds: what a slot load moves over PCIe
        self.expert_bytes = sum(t[0].numel() * t.element_size() for t in tensors.values())

    @classmethod
    def take(cls, module: torch.nn.Module, mode: str = "copy", reason: str = "weights taken from the loaded model"
             ) -> HostExperts:
        """Move ``module``'s expert weights to host memory (``mode``: 'copy' or 'pinned') and
        delete them from the module."""
        tensors = {}
        for kind in expert_kinds(module):
            tensors[kind] = resident(getattr(module, kind), mode)
            delattr(module, kind)
        return cls(tensors, getattr(module, "is_transposed", False), mode, reason)

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
